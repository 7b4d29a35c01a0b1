"""`launcher.footprint`: the memory `swarmnode up`'s swarm will take, estimated before it starts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from swarmnode.launcher.footprint import (
    GIB,
    PROCESS_BYTES,
    Footprint,
    _one_layer,
    _row_bytes,
    available_bytes,
    swarm_footprint,
)
from swarmnode.presets import get_preset
from swarmnode.runspec import RunSpec


def test_the_estimate_is_linear_in_the_batch_and_counts_every_node() -> None:
    spec = RunSpec.for_preset("tiny")
    one, two = swarm_footprint(spec, replicas=2, data_nodes=2), swarm_footprint(spec, 2, 2, standbys=1)
    assert one.in_flight == spec.microbatches * 2  # a stage node serves every data node's microbatches
    assert (one.nodes, two.nodes) == (8, 9)
    assert two.fixed_bytes - one.fixed_bytes == PROCESS_BYTES  # a standby holds no stage yet
    wider = swarm_footprint(replace(spec, batch_size=spec.batch_size + 1), 2, 2)
    assert wider.total_bytes - one.total_bytes == one.per_row_bytes > 0
    assert 2 * GIB < one.total_bytes < 8 * GIB  # 11 processes of a few hundred MiB, small tensors


def test_copies_and_replicas_add_what_they_hold() -> None:
    spec = RunSpec.for_preset("tiny")
    without = swarm_footprint(replace(spec, checkfree_plus=False), 2, 2)
    assert swarm_footprint(spec, 2, 2).fixed_bytes > without.fixed_bytes
    rows = [swarm_footprint(spec, replicas, 2).per_row_bytes for replicas in (1, 2, 3)]
    assert rows[2] - rows[1] == rows[1] - rows[0] > 0  # each replica of every stage pins its own microbatches


def test_a_sequence_twice_as_long_keeps_about_twice_the_activations() -> None:
    config = replace(get_preset("tiny").model, vocab_size=512)
    layer = _one_layer(config)
    short, long = _row_bytes(layer, config, 64), _row_bytes(layer, config, 128)
    assert short > 0 and 1.7 < long / short < 2.6  # linear in the tokens, plus attention's own share


def test_the_largest_batch_that_fits() -> None:
    footprint = Footprint(64, 10 * GIB, per_row_bytes=GIB, microbatch_bytes=0, in_flight=8, nodes=9)
    assert footprint.total_bytes == 74 * GIB
    assert footprint.largest_batch(16 * GIB) == 6
    assert footprint.largest_batch(10 * GIB) == 0  # not even one sequence


def test_available_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   16777216 kB\n")
    assert available_bytes(meminfo) == 16 * GIB
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert available_bytes(meminfo) is None  # an older kernel: no estimate, no refusal
    assert available_bytes(tmp_path / "missing") is None
