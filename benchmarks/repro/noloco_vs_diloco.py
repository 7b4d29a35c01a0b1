"""NoLoCo vs DiLoCo vs data parallel vs no synchronisation, with 8 replicas (spec/noloco.md).

Claim (NoLoCo paper): averaging with one random replica every H steps, no all-reduce, ends training at a
loss at least as good as DiLoCo's all-reduce outer step (14 of 16 settings better, by up to ~4% of
perplexity); both trail fully synchronous data parallel; the replicas' weights stay close; one pairwise
exchange costs ~2t against a tree all-reduce's ~2t log2(n).

Every method trains the same tokens: replica i reads shard i of 8 of the training split, one microbatch of
`batch_size` sequences per step, through the project's pieces, optimizer and schedule (`_replicas`):

- `data_parallel`: one model; each step averages the 8 replicas' gradients (an all-reduce every step).
- `diloco`: 8 replicas, fixed routing; every H_D steps `protocols.noloco.diloco_outer_step` over all of them
  (the paper's DiLoCo baseline: alpha 0.3, beta 0.7, H_D = 2 H).
- `noloco`: 8 replicas, each microbatch routed to a random replica of every stage (a random permutation per
  stage and step, so each replica takes one microbatch); every H steps each stage's replicas are paired by
  `protocols.noloco.match_replicas` on `pairing_seed` and step with `noloco_outer_step` (alpha 0.5,
  beta = gamma 0.7).
- `no_sync`: 8 replicas, fixed routing, never averaged.
- with `--ablation`, also `noloco_fixed_routing`: NoLoCo's outer step with each replica's own pipeline, to
  separate the pairing from the random routing.

Reported per seed: validation loss of the replica-averaged model and mean over the replicas' own pipelines,
the relative weight spread between replicas, and the synchronisation cost (`_exchange`: one exchange of a
stage's phi and theta over the real transport, against a tree all-reduce of log2(n) such rounds computed
from the measurement). H is scaled down to the run length (the `tiny` preset's H = 10); the model is two
stages of one layer (`SHAPE`), 8 sequences of 64 tokens per replica and step, peak inner lr `--lr`.

    python benchmarks/repro/noloco_vs_diloco.py --quick --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from _exchange import measure_exchanges, piece_state, tree_allreduce_s, tree_allreduce_stragglers_s
from _replicas import Replicas, Shape, TensorMap, corpus, stream, val_loss, validation
from _report import Row, cpu_seconds, plot, result, table, write_json

from protocols.noloco import (
    OuterConfig,
    diloco_outer_step,
    match_replicas,
    noloco_outer_step,
    pairing_seed,
)
from swarmnode.optim import Schedule
from swarmnode.presets import get_preset

METHODS = ("data_parallel", "diloco", "noloco", "no_sync")
ABLATION = ("noloco_fixed_routing",)
SHAPE = Shape(n_layers=2, batch_size=8)  # two stages of one layer, as the paper's 8 replicas x 2 stages
LR = 1e-3  # peak inner lr; the tiny preset's 3e-3 is compared in docs/reproduction.md (`--lr`)
CLAIM = (
    "NoLoCo (pairwise averaging with one random replica, random routing) ends at a loss at least as good as "
    "DiLoCo (all-reduce outer step), both behind data parallel; replicas stay close; a pairwise exchange "
    "costs 2t against a tree all-reduce's 2t log2(n)"
)
RUN_ID = "repro-noloco"


@dataclass(frozen=True)
class Mode:
    steps: int
    inner_steps: int  # NoLoCo's H; DiLoCo uses 2 H (the paper's 50 and 100)
    seeds: int
    val_batches: int
    repeats: int  # exchanges timed per seed and state
    big_states: bool  # also time a llama-124m stage's exchange


MODES = {
    "smoke": Mode(steps=4, inner_steps=1, seeds=1, val_batches=1, repeats=2, big_states=False),
    "quick": Mode(steps=80, inner_steps=10, seeds=1, val_batches=8, repeats=4, big_states=True),
    "full": Mode(steps=160, inner_steps=10, seeds=3, val_batches=16, repeats=6, big_states=True),
}


def train(
    method: str, seed: int, mode: Mode, shape: Shape, n: int, lr: float
) -> dict[str, float | list[float]]:
    """Train one method for one seed; its final figures and the averaged model's loss curve."""
    data = corpus()
    config = shape.model(data)
    n_stages = shape.n_layers
    schedule = Schedule(lr, get_preset("tiny").warmup_steps, mode.steps)
    replicas = Replicas(config, n_stages, 1 if method == "data_parallel" else n, seed, schedule)
    streams = [stream(data, shape, seed, (i, n)) for i in range(n)]
    fixed = validation(data, shape, mode.val_batches)
    noloco = OuterConfig(inner_steps=mode.inner_steps)
    diloco = OuterConfig(alpha=0.3, beta=0.7, inner_steps=2 * mode.inner_steps)
    stages = range(n_stages + 1)
    phi = [[replicas.params(k, r) for r in range(replicas.n)] for k in stages]
    delta: list[list[TensorMap | None]] = [[None] * replicas.n for _ in stages]
    routing = random.Random(f"{seed}/routing")
    curve = []
    for step in range(1, mode.steps + 1):
        perms = _permutations(routing, n, n_stages) if method == "noloco" else None
        for i in range(n):
            batch = next(streams[i])
            if method == "data_parallel":
                replicas.forward_backward(0, _hops(None, 0, n_stages), batch, 1.0 / n)
            else:
                replicas.forward_backward(i, _hops(perms, i, n_stages), batch, 1.0)
        replicas.step()
        if method.startswith("noloco") and step % noloco.inner_steps == 0:
            _noloco_outer(replicas, noloco, phi, delta, step // noloco.inner_steps)
        if method == "diloco" and step % diloco.inner_steps == 0:
            _diloco_outer(replicas, diloco, phi, delta)
        if step % diloco.inner_steps == 0:
            curve.append(val_loss(replicas.averaged(), fixed))
    own = [val_loss(replicas.pipeline(r), fixed) for r in range(replicas.n)]
    return {
        "averaged": val_loss(replicas.averaged(), fixed),
        "replicas": statistics.fmean(own),
        "worst": max(own),
        "spread": replicas.spread(),
        "curve": curve,
    }


def _hops(perms: list[list[int]] | None, i: int, n_stages: int) -> list[tuple[int, int]]:
    """(stage, replica) hops of replica i's microbatch: its own pipeline, or where NoLoCo's random routing
    drew a permutation of the replicas per stage, the replica it sends i to (each takes one microbatch)."""
    return [(k, i if perms is None else perms[k - 1][i]) for k in range(1, n_stages + 1)]


def _permutations(rng: random.Random, n: int, n_stages: int) -> list[list[int]]:
    return [rng.sample(range(n), n) for _ in range(n_stages)]


def _noloco_outer(replicas: Replicas, config: OuterConfig, phi: list, delta: list, outer: int) -> None:
    """Every stage: a random perfect matching of its replicas, each replica's outer step over its pair."""
    ids = [f"replica-{r}" for r in range(replicas.n)]
    for k in range(replicas.n_stages + 1):
        theta = [replicas.params(k, r) for r in range(replicas.n)]
        before = list(phi[k])  # every member steps from the pair's pre-step phi, as in the daemon's exchange
        for group in match_replicas(ids, pairing_seed(RUN_ID, k, outer), config.group_size):
            members = [ids.index(peer) for peer in group]
            for r in members:
                others = [j for j in members if j != r]
                out = noloco_outer_step(
                    config,
                    before[r],
                    theta[r],
                    delta[k][r],
                    [before[j] for j in others],
                    [theta[j] for j in others],
                )
                phi[k][r], delta[k][r] = out.phi, out.delta
        for r in range(replicas.n):
            replicas.load(k, r, phi[k][r])


def _diloco_outer(replicas: Replicas, config: OuterConfig, phi: list, delta: list) -> None:
    """Every stage: the all-reduce outer step over all replicas, which then share the new phi."""
    for k in range(replicas.n_stages + 1):
        thetas = [replicas.params(k, r) for r in range(replicas.n)]
        out = diloco_outer_step(config, phi[k][0], delta[k][0], thetas)
        for r in range(replicas.n):
            phi[k][r], delta[k][r] = out.phi, out.delta
            replicas.load(k, r, out.phi)


def sync_rows(
    mode: Mode, shape: Shape, n: int, n_seeds: int
) -> tuple[list[Row], dict[str, dict[str, float]]]:
    """Per state: the measured pairwise exchange and the tree all-reduce computed from it, one value per seed
    (each seed its own batch of timed exchanges); and the tree/pairwise ratios at n and at 1024."""
    config = shape.model(corpus())
    states = {"bench data stage": piece_state(config, 0, shape.n_layers)}
    if mode.big_states:
        paper = get_preset("llama-124m")
        states["llama-124m stage"] = piece_state(paper.model, 1, paper.n_stages)
    timed = measure_exchanges([s for _ in range(n_seeds) for s in states.values()], mode.repeats)
    rows, ratios, rng = [], {}, random.Random(0)
    for j, label in enumerate(states):
        runs = timed[j :: len(states)]
        metric = f"sync s/outer step, {label}"
        pairwise = [statistics.median(t) for t in runs]
        tree = [tree_allreduce_s(t, n) for t in runs]
        slow = [tree_allreduce_stragglers_s(t, n, rng) for t in runs]
        rows += [
            Row("noloco pairwise (measured)", metric, tuple(pairwise)),
            Row(f"tree all-reduce n={n}", metric, tuple(tree)),
            Row(f"tree n={n}, stragglers", metric, tuple(slow)),
        ]
        every = [x for t in runs for x in t]
        ratios[label] = {
            "bytes_each_way": 2 * sum(t.numel() * t.element_size() for t in states[label].values()),
            "pairwise_s": statistics.median(every),
            f"tree_over_pairwise_n{n}": statistics.fmean(tree) / statistics.fmean(pairwise),
            f"tree_stragglers_over_pairwise_n{n}": statistics.fmean(slow) / statistics.fmean(pairwise),
            "tree_over_pairwise_n1024": tree_allreduce_s(every, 1024) / statistics.median(every),
            "tree_stragglers_over_pairwise_n1024": tree_allreduce_stragglers_s(every, 1024, rng, 50)
            / statistics.median(every),
        }
    return rows, ratios


def verdict(final: dict[str, dict[str, list[float]]], sync: dict[str, dict[str, float]], n: int) -> str:
    """The verdict from the numbers: NoLoCo vs DiLoCo per seed, data parallel ahead, spread bounded."""
    mean = {m: {k: statistics.fmean(v) for k, v in final[m].items()} for m in final}
    nolo, dilo = final["noloco"]["replicas"], final["diloco"]["replicas"]
    wins = sum(a < b for a, b in zip(nolo, dilo, strict=True))
    gap = math.exp(mean["noloco"]["replicas"] - mean["diloco"]["replicas"]) - 1  # < 0: NoLoCo better
    dp_first = mean["data_parallel"]["replicas"] < min(mean["noloco"]["replicas"], mean["diloco"]["replicas"])
    bounded = mean["noloco"]["spread"] < mean["no_sync"]["spread"]
    if wins == len(nolo) and dp_first and bounded:
        word = "reproduced"
    elif (gap <= 0 or abs(gap) <= 0.01) and bounded:
        word = "in shape"
    else:
        word = "not reproduced"
    first = next(iter(sync.values()))
    return (
        f"{word}: per-replica val loss noloco {mean['noloco']['replicas']:.4f} vs diloco "
        f"{mean['diloco']['replicas']:.4f} (perplexity {gap:+.2%} relative to diloco; noloco lower in "
        f"{wins}/{len(nolo)} seeds), data parallel {mean['data_parallel']['replicas']:.4f} "
        f"({'ahead of both' if dp_first else 'not ahead of both'}), "
        f"no_sync {mean['no_sync']['replicas']:.4f}; "
        f"weight spread noloco {mean['noloco']['spread']:.4f} vs no_sync {mean['no_sync']['spread']:.4f} "
        f"({'bounded' if bounded else 'not bounded'}); a tree all-reduce over {n} replicas takes "
        f"{first[f'tree_over_pairwise_n{n}']:.1f}x one pairwise exchange measured on the transport "
        f"({first[f'tree_stragglers_over_pairwise_n{n}']:.1f}x with stragglers; "
        f"{first['tree_over_pairwise_n1024']:.1f}x at n=1024)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--quick", action="store_true", help="one seed, 80 steps (a few minutes)")
    speed.add_argument("--smoke", action="store_true", help="seconds: for the test only")
    parser.add_argument("--seeds", type=int, help="number of seeds (0, 1, ...); default by mode")
    parser.add_argument("--replicas", type=int, default=8, help="replicas per stage (at least 8)")
    parser.add_argument("--lr", type=float, default=LR, help=f"peak inner learning rate (default {LR})")
    parser.add_argument("--ablation", action="store_true", help="also NoLoCo with fixed routing")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    args = parser.parse_args()
    if args.replicas < 8 and not args.smoke:
        parser.error("the claim is about at least 8 replicas")
    torch.set_num_threads(1)
    name = "smoke" if args.smoke else "quick" if args.quick else "full"
    mode, shape, n = MODES[name], SHAPE, args.replicas
    seeds = list(range(args.seeds if args.seeds is not None else mode.seeds))
    started = time.perf_counter()
    methods = METHODS + ABLATION if args.ablation else METHODS
    final: dict[str, dict[str, list[float]]] = {m: {} for m in methods}
    curves: dict[str, list[list[float]]] = {m: [] for m in methods}
    for seed in seeds:
        for method in methods:
            tick = time.perf_counter()
            out = train(method, seed, mode, shape, n, args.lr)
            for key, value in out.items():
                if key == "curve":
                    curves[method].append(value)  # type: ignore[arg-type]
                else:
                    final[method].setdefault(key, []).append(value)  # type: ignore[arg-type]
            print(
                f"seed {seed} {method:<14} {json.dumps({k: v for k, v in out.items() if k != 'curve'})} "
                f"({time.perf_counter() - tick:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    rows = [
        Row(m, metric, tuple(final[m][key]))
        for key, metric in (
            ("averaged", "val loss, averaged model"),
            ("replicas", "val loss, mean of replicas"),
            ("spread", "relative weight spread"),
        )
        for m in methods
    ]
    sync_table, sync = sync_rows(mode, shape, n, len(seeds))
    rows += sync_table
    dp = statistics.fmean(final["data_parallel"]["replicas"])
    body = result(
        CLAIM,
        rows,
        verdict(final, sync, n),
        replicas=n,
        mode=name,
        steps=mode.steps,
        inner_steps={"noloco": mode.inner_steps, "diloco": 2 * mode.inner_steps},
        model={
            "dim": shape.dim,
            "layers": shape.n_layers,
            "stages": shape.n_layers,
            "seq_len": shape.seq_len,
            "batch_per_replica": shape.batch_size,
            "lr": args.lr,
        },
        perplexity_vs_data_parallel={
            m: math.exp(statistics.fmean(final[m]["replicas"]) - dp) for m in methods
        },
        paper={
            "setting": "125M, 8 replicas x 2 stages, Reddit",
            "perplexity": {"data_parallel": 25.5, "diloco": 27.6, "noloco": 27.2},
        },
        worst_replica={m: final[m]["worst"] for m in methods},
        curves={"every_steps": 2 * mode.inner_steps, "val_loss_averaged_model": curves},
        sync=sync,
        seconds=round(time.perf_counter() - started, 1),
        cpu_seconds=cpu_seconds(),
    )
    print(table(rows))
    print(body["verdict"])
    if args.json:
        write_json(args.json, body)
    if args.plot:
        plot(args.plot, f"NoLoCo vs DiLoCo, {n} replicas, {mode.steps} steps, {len(seeds)} seed(s)", rows)


if __name__ == "__main__":
    main()
