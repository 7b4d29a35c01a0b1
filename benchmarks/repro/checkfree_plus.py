"""CheckFree+ (spec/checkfree.md): rebuilding the edge stages S1 and Ss, and the embeddings, with and without
the edge swaps; and what the swaps cost when nothing fails.

A model of the tiny preset's dimensions in 6 stages of one layer is trained to a snapshot twice per seed: with
CheckFree+ swaps (`protocols.checkfree.swaps_edge_pairs`: every other microbatch runs
`E, S2, S1, S3, S4, S6, S5, E'`; the copies of `E` and `E'` refreshed every `--refresh` steps) and without.
Each snapshot is forked and one piece lost:

- S1 or Ss lost, rebuilt as `plan_recovery` plans it (`copy`: with swaps, a copy of the swap partner; without,
  a copy of the only transformer neighbour, which never trained in its place), or re-initialised (`reinit`);
- the embeddings (stage 0: `E` and `E'`) lost, restored from the copies (`restore`, CheckFree+ only) or
  re-initialised (`reinit`);
- `no_failure`: the control of each regime.

Rebuilds follow the plan's optimizer rules (fresh Adam; lr x1.1 for a copy, x1 for a restore or a reinit).
Measured per seed: validation loss just after and `--window` steps after the loss, and steps to regain the
regime's pre-failure loss. The paper: a swapped partner is a good S1/Ss, the copies restore the embeddings
exactly, and the swaps cost a little convergence when nothing fails.

    python benchmarks/repro/checkfree_plus.py --quick --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from _report import Row, cpu_seconds, plot, result, table, write_json
from _staged import (
    Data,
    Setup,
    StagedModel,
    common_args,
    mean_curve,
    mode_name,
    plot_curves,
    steps_to_regain,
)

from protocols.checkfree import Method

# mode: (setup, snapshot steps, window after the failure, evaluate every, seeds, copy refresh steps)
MODES = {
    "smoke": (Setup(seq_len=32, val_batches=1), 8, 3, 3, 2, 2),  # 4 swapped steps: MIN_STAND_INS
    "quick": (Setup(), 75, 25, 5, 3, 10),
    "full": (Setup(), 105, 40, 5, 3, 10),
}
REGIMES = {"swaps": True, "no swaps": False}


def forks(regime: str, n_stages: int) -> list[tuple[str, int, str]]:
    """(method name, lost stage, how) for one regime; how is 'none', 'plan' or 'reinit'."""
    out = [(f"no_failure ({regime})", -1, "none")]
    for stage, label in ((1, "S1"), (n_stages, "Ss")):
        out += [(f"{label} copy ({regime})", stage, "plan"), (f"{label} reinit ({regime})", stage, "reinit")]
    if REGIMES[regime]:
        out += [("E restore (swaps)", 0, "plan"), ("E reinit (swaps)", 0, "reinit")]
    return out


def lose(model: StagedModel, stage: int, how: str, checkfree_plus: bool) -> str:
    """Lose `stage` of `model` and rebuild it; returns the method actually used."""
    plan = model.plan(stage, {stage}, checkfree_plus)
    if how == "reinit" or plan.method is Method.REINIT:
        model.install(stage, model.reinit_weights(stage), 1.0)
        return "reinit"
    model.rebuild(plan)
    return plan.method.value


def run_seed(
    setup: Setup, data: Data, seed: int, snapshot: int, window: int, every: int, refresh: int
) -> dict[str, object]:
    out: dict[str, object] = {"seed": seed, "pre_failure_val": {}, "curves": {}, "methods_used": {}}
    for regime, plus in REGIMES.items():
        model = StagedModel(setup, data.corpus.vocab_size, seed)
        if plus:
            model.refresh_copies()  # taken when the stage-1 and stage-s nodes come online
        for _ in range(snapshot):
            model.train_step(data, checkfree_plus=plus)
            if plus and model.step % refresh == 0:
                model.refresh_copies()
        before = model.evaluate(data)
        out["pre_failure_val"][regime] = before  # type: ignore[index]
        for name, stage, how in forks(regime, setup.n_stages):
            fork = model.fork()
            if stage >= 0:
                out["methods_used"][name] = lose(fork, stage, how, plus)  # type: ignore[index]
            curve = [(0, fork.evaluate(data))]
            for step in range(1, window + 1):
                fork.train_step(data, checkfree_plus=plus)
                if plus and fork.step % refresh == 0:
                    fork.refresh_copies()
                if step % every == 0 or step == window:
                    curve.append((step, fork.evaluate(data)))
            out["curves"][name] = curve  # type: ignore[index]
    return out


def verdict(final: dict[str, list[float]], snapshot_val: dict[str, list[float]]) -> str:
    """A claim holds if it holds, seed by seed (paired: same batches), in at least two thirds of the seeds."""

    def excess(name: str) -> list[float]:
        control = final[f"no_failure ({_regime(name)})"]
        return [v - c for v, c in zip(final[name], control, strict=True)]

    def below(a: list[float], b: list[float]) -> list[bool]:
        return [x < y for x, y in zip(a, b, strict=True)]

    checks = {
        "with swaps, copy beats reinit for S1 and Ss": [
            all(pair)
            for pair in zip(
                *(below(final[f"{s} copy (swaps)"], final[f"{s} reinit (swaps)"]) for s in ("S1", "Ss")),
                strict=True,
            )
        ],
        "a swapped partner's copy costs less than a plain neighbour's copy for S1 and Ss": [
            all(pair)
            for pair in zip(
                *(below(excess(f"{s} copy (swaps)"), excess(f"{s} copy (no swaps)")) for s in ("S1", "Ss")),
                strict=True,
            )
        ],
        "restoring E, E' from the copies beats reinit": below(
            final["E restore (swaps)"], final["E reinit (swaps)"]
        ),
        "swaps cost convergence when nothing fails": below(snapshot_val["no swaps"], snapshot_val["swaps"]),
    }
    n = len(snapshot_val["swaps"])
    majority = -(-2 * n // 3)
    held = [k for k, seeds in checks.items() if sum(seeds) >= majority]
    failed = [f"{k} ({sum(seeds)} of {n} seeds)" for k, seeds in checks.items() if sum(seeds) < majority]
    head = "reproduced" if not failed else "in shape" if len(held) >= len(checks) - 1 else "not reproduced"
    return f"{head}: holds: {'; '.join(held) or 'none'}; does not hold: {'; '.join(failed) or 'none'}"


def summarise(runs: list[dict], window: int, snapshot: int) -> tuple[list[Row], str]:
    """The rows and the verdict of a set of seeds' runs."""
    names = list(runs[0]["curves"])
    final = {n: [r["curves"][n][-1][1] for r in runs] for n in names}
    right_after = {n: [r["curves"][n][0][1] for r in runs] for n in names}
    pre = {g: [r["pre_failure_val"][g] for r in runs] for g in REGIMES}
    regain = {
        n: [
            float(steps_to_regain(r["curves"][n][1:], r["pre_failure_val"][_regime(n)], window)) for r in runs
        ]
        for n in names
    }
    rows = [Row(n, "val loss just after the loss", tuple(right_after[n])) for n in names]
    rows += [Row(n, f"val loss {window} steps after", tuple(final[n])) for n in names]
    rows += [Row(n, f"steps to regain (cap {window})", tuple(regain[n])) for n in names]
    rows += [Row(f"no_failure ({g})", f"val loss at step {snapshot}", tuple(pre[g])) for g in REGIMES]
    return rows, verdict(final, pre)


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--refresh", type=int, default=None, help="refresh the copies of E, E' every N steps")
    args = parser.parse_args()
    if args.rescore:
        body = json.loads(Path(args.rescore).read_text())
        rows, text = summarise(body["runs"], body["window"], body["snapshot_steps"])
        body.update(result(body["claim"], rows, text))
        report(body, rows, args)
        return
    torch.set_num_threads(args.threads)
    mode = mode_name(args)
    setup, snapshot, window, every, n_seeds, refresh = MODES[mode]
    n_seeds, refresh = args.seeds or n_seeds, args.refresh or refresh
    data = Data(setup)
    started = time.perf_counter()
    runs = []
    for seed in range(n_seeds):
        runs.append(run_seed(setup, data, seed, snapshot, window, every, refresh))
        print(f"seed {seed} done at {time.perf_counter() - started:.0f} s", flush=True)
    rows, text = summarise(runs, window, snapshot)
    data_piece = StagedModel(setup, data.corpus.vocab_size, 0).pieces[0]
    copy_bytes = sum(t.numel() * t.element_size() for t in data_piece.state_dict().values())
    body = result(
        "CheckFree+: swaps make S1/Ss recoverable by copy, copies restore E/E', swaps cost a little",
        rows,
        text,
        mode=mode,
        stages=setup.n_stages,
        snapshot_steps=snapshot,
        window=window,
        copy_refresh_steps=refresh,
        copy_staleness_steps=snapshot % refresh,
        copies_bytes=copy_bytes,
        setup=setup.__dict__,
        runs=runs,
        seconds=round(time.perf_counter() - started, 1),
        cpu_seconds=cpu_seconds(),
    )
    report(body, rows, args)


def report(body: dict, rows: list[Row], args: argparse.Namespace) -> None:
    print(table(rows))
    print(body["verdict"])
    if args.json:
        write_json(Path(args.json), body)
    if args.plot:
        runs = body["runs"]
        title = f"CheckFree+ edge stages ({body['mode']}, {len(runs)} seeds)"
        curves = {n: mean_curve([r["curves"][n] for r in runs]) for n in runs[0]["curves"]}
        panels = [
            (group, {n: c for n, c in curves.items() if n.startswith((group, "no_failure"))})
            for group in ("S1", "Ss", "E")
        ]
        plot_curves(args.plot, title, panels)
        plot(Path(args.plot).with_suffix(".bars.png"), title, rows)


def _regime(name: str) -> str:
    return "no swaps" if name.endswith("(no swaps)") else "swaps"


if __name__ == "__main__":
    main()
