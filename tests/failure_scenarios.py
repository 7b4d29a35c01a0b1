"""Shared by the failure tests (tests/test_failures.py, tests/test_rebalance.py): a small loopback swarm
that trains the tiny preset with short timeouts, SIGKILLs of whole process groups, and checks of what the
replacements did and that training went on."""

from __future__ import annotations

import json
import math
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from statistics import mean
from typing import Any

import torch
from swarm_harness import LocalTestSwarm, NodeProcess, group_members, poll, stage_peers

from swarmnode.pieces import build_piece
from swarmnode.presets import get_preset
from swarmnode.runspec import RunSpec

# The runs: the tiny preset with a shorter iteration timeout than the default 30 s, so that the worst case
# of the bound (an iteration waiting its whole timeout for a lost microbatch) costs seconds, not minutes.
RUN = {"preset": "tiny", "iteration_timeout_s": 10.0, "hop_timeout_s": 5.0}
SPEC = RunSpec.from_dict({**RunSpec.for_preset("tiny").to_dict(), **RUN})
STEPS = 1000  # never reached: a test stops its swarm once it has seen what it needs
TOKENS_PER_MICROBATCH = SPEC.batch_size * SPEC.seq_len
ITERATION_BOUND_S = SPEC.iteration_timeout_s + 8.0  # the timeout, plus slack for a loaded machine
START_S = 120.0  # bound for a process to come online on a loaded 2-core machine
WINDOW = 5  # steps per loss window


def start_swarm(
    swarm: LocalTestSwarm,
    stages: list[int],
    *options: str,
    run: dict[str, Any] | None = None,
    **bootstrap: Any,
) -> tuple[NodeProcess, list[NodeProcess]]:
    """Bootstrap (`RUN`, updated by `run`), the stage nodes (waited online; `options` go to their `join`),
    then the data node."""
    run_file = swarm.folder / "run.json"
    run_file.write_text(json.dumps({**RUN, **(run or {})}))
    swarm.bootstrap("--run", str(run_file), **{"steps": STEPS, **bootstrap})
    nodes = [swarm.join(k, *options) for k in stages]
    swarm.wait_online(*nodes, timeout=START_S)
    data = swarm.join(0, name="data")
    data.wait_event("online", START_S)
    swarm.note_sockets()
    return data, nodes


def replace_one_by_one(
    swarm: LocalTestSwarm, victims: list[tuple[NodeProcess, int]]
) -> Iterator[tuple[int, float, dict[str, Any], dict[str, Any], Path]]:
    """For each (node, its stage) in turn: kill it, start a `join --stage auto` replacement that dumps its
    recovery, and wait for it to recover and come online. Yields (stage, kill time, its "recovered" and
    "online" events, the dump folder); the next node is killed once the caller has checked this one."""
    for victim, stage in victims:
        dump = swarm.folder / f"dump{stage}"
        killed = kill(swarm, victim)
        recovered, online = wait_recovered(swarm, join_auto(swarm, f"new{stage}", dump))
        yield stage, killed, recovered, online, dump


def wait_step(data: NodeProcess, step: int, timeout: float = START_S) -> dict[str, Any]:
    return data.wait_event("step", timeout, where=lambda e: e["step"] >= step)


def kill(swarm: LocalTestSwarm, *nodes: NodeProcess) -> float:
    """SIGKILL the whole process group of each node (daemon, p2pd); the unix time of the kill."""
    swarm.note_sockets()  # their p2pd sockets stay behind; the fixture removes them
    for node in nodes:
        node.kill_group(signal.SIGKILL)
    killed = time.time()
    for node in nodes:
        node.wait_exit(10)
    pgids = [node.pgid for node in nodes]
    poll(lambda: not group_members(pgids), 10, "the killed process groups to be gone")
    return killed


def join_auto(swarm: LocalTestSwarm, name: str, dump: Path) -> NodeProcess:
    return swarm.join("auto", "--dump-recovery", str(dump), name=name)


def wait_recovered(swarm: LocalTestSwarm, node: NodeProcess) -> tuple[dict[str, Any], dict[str, Any]]:
    """The node's `recovered` and `online` events."""
    recovered = node.wait_event("recovered", START_S)
    online = node.wait_event("online", START_S)
    swarm.note_sockets()
    return recovered, online


def load_dump(folder: Path, stage: int) -> dict[str, Any]:
    files = sorted(folder.glob(f"recovery-stage{stage}-*.pt"))
    assert len(files) == 1, f"expected one recovery dump of stage {stage} in {folder}: {files}"
    return torch.load(files[0])


def initial_weights(stage: int, vocab_size: int, seed: int = SPEC.seed) -> dict[str, torch.Tensor]:
    """The weights of `stage` drawn from `seed`: by default the run's seeded initial weights (what every node
    starts from before training)."""
    config = replace(get_preset(SPEC.preset).model, vocab_size=vocab_size)
    piece = build_piece(config, stage, SPEC.stages, seed)
    return {name: p.detach() for name, p in piece.named_parameters()}


def assert_trained(tensors: dict[str, torch.Tensor], stage: int, vocab_size: int = SPEC.vocab_size) -> None:
    """`tensors` have stage `stage`'s layout and are not its initial weights (they were trained)."""
    initial = initial_weights(stage, vocab_size)
    assert set(tensors) == set(initial), sorted(set(tensors) ^ set(initial))[:5]
    changed = [n for n, t in tensors.items() if not torch.allclose(t, initial[n], rtol=0, atol=1e-6)]
    assert len(changed) >= len(initial) // 2, f"stage {stage}: only {changed} differ from the initial weights"


def initial_loss(vocab_size: int) -> float:
    """The loss of uniform predictions: where an untrained (or re-initialised) data stage starts."""
    return math.log(vocab_size)


def steps_between(data: NodeProcess, after: float, before: float = math.inf) -> list[dict[str, Any]]:
    return [e for e in data.events("step") if after < e["time"] < before]


def wait_steps_through(data: NodeProcess, stage: int, after: float, count: int) -> list[dict[str, Any]]:
    """Wait for `count` step events after unix time `after` whose planned paths all include `stage`."""

    def enough() -> list[dict[str, Any]] | None:
        through = [e for e in steps_between(data, after) if all(stage in p for p in e["paths"])]
        return through if len(through) >= count else None

    return poll(enough, START_S, f"{count} steps through stage {stage}", alive=data.check_alive)


def record_of(swarm: LocalTestSwarm, stage: int, peer: str) -> dict[str, Any]:
    """The node's record as `swarmnode status --json` shows it."""
    peers = {p["peer_id"]: p for p in stage_peers(swarm.status(), stage)}
    assert peer in peers, f"{peer[-8:]} not listed in stage {stage}: {sorted(peers)}"
    return peers[peer]


def assert_learning(data: NodeProcess, killed: float) -> None:
    """Every loss finite; the last window's mean below the window before the kill."""
    steps = data.events("step")
    losses = [e["loss"] for e in steps]
    assert all(math.isfinite(x) for x in losses), losses
    before = [e["loss"] for e in steps if e["time"] < killed][-WINDOW:]
    last = losses[-WINDOW:]
    assert len(before) == WINDOW and steps[-WINDOW]["time"] > killed
    assert mean(last) < mean(before), (before, last, losses)


def assert_waited_meanwhile(data: NodeProcess, stage: int, killed: float, recovered: float) -> None:
    """After the kill no iteration waited past the bound, and none trained past the lost stage: a run that
    skips nothing (`SPEC.skip_ratio` 0) waits for its rebuild (`membership.RebuildWait`), so every path of an
    iteration planned once the dead node's record had expired (TTL, then a refresh of the data node's view)
    and before the replacement announced itself still visits the stage (there may be none)."""
    after = steps_between(data, killed)
    assert all(e["seconds"] < ITERATION_BOUND_S for e in after), [e["seconds"] for e in after]
    expired = killed + SPEC.record_ttl_s + 2 * SPEC.record_period_s
    meanwhile = [e for e in after if expired < e["time"] - e["seconds"] < recovered]
    assert all(stage in path for e in meanwhile for path in e["paths"]), meanwhile
