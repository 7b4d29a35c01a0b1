"""The memory a local swarm will take, estimated before `swarmnode up` starts it.

A paper-sized preset can ask a CPU machine for far more than it has: `up --preset llama-124m` trains
microbatches of 64 x 512 tokens, and a stage node keeps the activations of every microbatch in flight until
its backward pass (8.3 GiB a microbatch for a stage of three llama-124m layers), so a stage process grew
past 20 GB, the kernel killed it, and the swarm had stalled at step 0. `up` now estimates the swarm first
and refuses, in one line, a swarm the machine cannot hold, naming the largest `--batch-size` that fits.

What a node holds:
- its process: the interpreter, torch, hivemind and its p2pd, `PROCESS_BYTES` before any tensor (268-333 MiB
  PSS per daemon measured, `docs/scaling.md`); the bootstrap, the observer and the zygote too;
- `STATE_COPIES` of its piece's parameters: the weights, the gradient sums, a backward pass's fresh
  gradients, Adam's two moments, and NoLoCo's slow weights and momentum;
- the CheckFree+ copies it keeps (`protocols.checkfree.copies_kept`, their layouts from `pieces.copy_layout`);
- activations: a stage node those of `microbatches` microbatches of each data node at once (a data node
  sends that many through every pipeline), a data node those of one pass through the output head (its
  embedding keeps only token ids).

Activations are measured, not modelled: one decoder layer and the output head run forward on the CPU, in
float32, for one and for two sequences of the run's length, and what one more sequence adds to the tensors
autograd keeps for the backward pass (`saved_tensors_hooks`, each storage counted once, weights left out)
is a sequence's share. The rest is linear in the batch size, which `largest_batch` solves for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from protocols.checkfree import copies_kept
from swarmnode.model import DecoderStage, OutputHead, TokenEmbedding, build_head, build_stage
from swarmnode.model_config import ModelConfig, stage_layers
from swarmnode.pieces import copy_layout
from swarmnode.presets import get_preset
from swarmnode.runspec import RunSpec

GIB = 2**30
PROCESS_BYTES = 350 << 20  # a daemon before any tensor (PSS 268-333 MiB measured), rounded up
STATE_COPIES = 7  # weights, gradient sums, fresh gradients, Adam's m and v, NoLoCo's phi and delta
OTHER_PROCESSES = 3  # the bootstrap peer, the observer (`swarmnode status`) and the zygote
FLOAT32 = 4


@dataclass(frozen=True)
class Footprint:
    """A swarm's estimated memory: `fixed_bytes` whatever the batch, plus `per_row_bytes` per sequence of
    `batch_size` (summed over every node); `microbatch_bytes` is what one microbatch pins at the largest
    stage, which holds at most `in_flight` of them."""

    batch_size: int
    fixed_bytes: int
    per_row_bytes: int
    microbatch_bytes: int
    in_flight: int
    nodes: int

    @property
    def total_bytes(self) -> int:
        return self.fixed_bytes + self.batch_size * self.per_row_bytes

    def largest_batch(self, available_bytes: int) -> int:
        """The largest batch size whose swarm fits in `available_bytes` (0: none does)."""
        return max(0, (available_bytes - self.fixed_bytes) // max(1, self.per_row_bytes))


def swarm_footprint(spec: RunSpec, replicas: int, data_nodes: int, standbys: int = 0) -> Footprint:
    """The memory of `up`'s swarm for `spec`: `data_nodes` data nodes, `replicas` nodes of every stage."""
    config = replace(get_preset(spec.preset).model, vocab_size=spec.vocab_size)
    layer_row = _row_bytes(_one_layer(config), config, spec.seq_len)
    head_row = _row_bytes(build_head(config), config, spec.seq_len)
    in_flight = spec.microbatches * data_nodes
    fixed = (OTHER_PROCESSES + standbys) * PROCESS_BYTES
    per_row = 0
    largest = 0
    for stage in range(spec.stages + 1):
        copies = copies_kept(stage, spec.stages, spec.edge_copies) if spec.checkfree_plus else ()
        held = STATE_COPIES * _piece_bytes(config, stage, spec.stages)
        held += sum(_bytes(copy_layout(config, part, spec.stages).values()) for part in copies)
        if stage == 0:
            fixed += data_nodes * (PROCESS_BYTES + held)
            per_row += data_nodes * head_row
            continue
        row = len(stage_layers(config, stage, spec.stages)) * layer_row
        largest = max(largest, row)
        fixed += replicas * (PROCESS_BYTES + held)
        per_row += replicas * in_flight * row
    nodes = data_nodes + replicas * spec.stages + standbys
    return Footprint(spec.batch_size, fixed, per_row, spec.batch_size * largest, in_flight, nodes)


def available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The memory this machine can give new processes (`MemAvailable`); None where the system does not say."""
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == "MemAvailable" and value.split() and value.split()[0].isdigit():
            return int(value.split()[0]) * 1024
    return None


def _one_layer(config: ModelConfig) -> nn.Module:
    return build_stage(replace(config, n_layers=1), 1, 1)


def _piece_bytes(config: ModelConfig, stage: int, n_stages: int) -> int:
    with torch.device("meta"):
        if stage == 0:
            modules: list[nn.Module] = [TokenEmbedding(config), OutputHead(config)]
        else:
            modules = [DecoderStage(config, len(stage_layers(config, stage, n_stages)))]
    return sum(_bytes(module.parameters()) for module in modules)


def _bytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * FLOAT32 for t in tensors)


def _row_bytes(module: nn.Module, config: ModelConfig, seq_len: int) -> int:
    """What one more sequence of `seq_len` adds to the tensors `module`'s forward keeps for its backward."""
    if isinstance(module, OutputHead):

        def run(rows: int) -> None:
            targets = torch.randint(0, config.vocab_size, (rows, seq_len))
            module.loss(torch.randn(rows, seq_len, config.dim, requires_grad=True), targets)

    else:

        def run(rows: int) -> None:
            module(torch.randn(rows, seq_len, config.dim, requires_grad=True))

    return max(0, _saved_bytes(module, run, 2) - _saved_bytes(module, run, 1))


def _saved_bytes(module: nn.Module, run: Callable[[int], None], rows: int) -> int:
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run(rows)
    return sum(kept.values())
