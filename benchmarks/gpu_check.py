"""GPU check: the single-process trainer and a small swarm on CUDA against the CPU, as a table.

Rows, in one run, all on the same preset, steps and seed:

- `train`: `swarmnode.trainer.train` on the CPU in float32 (the baseline), then on CUDA in float32, bfloat16
  and float16 (autocast, float32 master weights; float16 with its loss scaler);
- `swarm`: `swarmnode up --calm --data-nodes 1 --replicas 1` (four daemons: one data node and one node per
  stage of the 3-stage preset) with `--device cpu`, then with `--device cuda` (four processes sharing one
  GPU) in float32 and bfloat16.

Columns: tokens/s (the trainer's compute-only figure; the swarm's wall-clock figure from its report), the
ratio to the CPU float32 row of the same kind, the final validation loss, and the seconds the row took.
Where CUDA is absent the CUDA rows are listed as skipped, so the CPU path still runs end to end.

    python benchmarks/gpu_check.py                        # tiny preset, 60 trainer steps, 40 swarm steps
    python benchmarks/gpu_check.py --preset llama-124m --steps 100 --swarm-steps 50 --json gpu.json
    python benchmarks/gpu_check.py --no-swarm --steps 10  # the trainer rows only (a quick look)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarmnode.trainer import TrainConfig, train


@dataclass(frozen=True)
class Row:
    kind: str  # train or swarm
    device: str
    dtype: str
    tokens_per_second: float | None
    val_loss: float | None
    seconds: float
    note: str = ""


def train_row(preset: str, steps: int, device: str, dtype: str, seed: int, eval_batches: int | None) -> Row:
    started = time.perf_counter()
    config = TrainConfig(
        preset, None, steps, None, None, seed, steps, eval_batches, device=device, dtype=dtype
    )
    result = train(config)
    return Row(
        "train", device, dtype, result.tokens_per_second, result.val_loss, time.perf_counter() - started
    )


def swarm_row(preset: str, steps: int, device: str, dtype: str, seed: int, timeout: float) -> Row:
    out = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    argv = [
        sys.executable, "-m", "swarmnode", "up", "--calm", "--preset", preset, "--data-nodes", "1",
        "--replicas", "1", "--steps", str(steps), "--seed", str(seed), "--device", device, "--dtype", dtype,
        "--out", str(out / "run"), "--timeout", str(timeout),
    ]  # fmt: skip
    started = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 120, check=False)
        seconds = time.perf_counter() - started
        report_path = out / "run" / "report.json"
        report: dict[str, Any] = json.loads(report_path.read_text()) if report_path.is_file() else {}
        if report.get("outcome") != "completed":  # the evidence, before the run's folder goes
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
            print(f"swarm row {device} {dtype} did not complete:\n{tail}", file=sys.stderr)
        if not report:
            return Row("swarm", device, dtype, None, None, seconds, f"no report (exit {done.returncode})")
        note = "" if report["outcome"] == "completed" else report["outcome"]
        return Row("swarm", device, dtype, report["tokens_per_second"], report["val_loss"], seconds, note)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def table(rows: list[Row]) -> str:
    baselines = {r.kind: r.tokens_per_second for r in rows if r.device == "cpu" and r.dtype == "float32"}
    lines = [
        f"{'kind':<6} {'device':<7} {'dtype':<9} {'tokens/s':>10} {'x cpu':>7} {'val loss':>9} {'s':>7}  note"
    ]
    for r in rows:
        base = baselines.get(r.kind)
        ratio = f"{r.tokens_per_second / base:7.2f}" if r.tokens_per_second and base else f"{'-':>7}"
        tps = f"{r.tokens_per_second:10.0f}" if r.tokens_per_second else f"{'-':>10}"
        loss = f"{r.val_loss:9.4f}" if r.val_loss is not None else f"{'-':>9}"
        lines.append(
            f"{r.kind:<6} {r.device:<7} {r.dtype:<9} {tps} {ratio} {loss} {r.seconds:7.1f}  {r.note}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=60, help="trainer steps per row")
    parser.add_argument("--swarm-steps", type=int, default=40, help="swarm steps per row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--eval-batches",
        type=int,
        default=None,
        help="trainer validation batches (default: the standard set)",
    )
    parser.add_argument("--no-swarm", action="store_true", help="only the trainer rows")
    parser.add_argument("--swarm-timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else "none"
    print(
        f"torch {torch.__version__}, CUDA device: {name}, CPU threads: {torch.get_num_threads()}, "
        f"load: {os.getloadavg()[0]:.1f}",
        file=sys.stderr,
    )
    rows = [train_row(args.preset, args.steps, "cpu", "float32", args.seed, args.eval_batches)]
    for dtype in ("float32", "bfloat16", "float16"):
        rows.append(
            train_row(args.preset, args.steps, "cuda", dtype, args.seed, args.eval_batches)
            if cuda
            else Row("train", "cuda", dtype, None, None, 0.0, "skipped: no CUDA device")
        )
    if not args.no_swarm:
        rows.append(swarm_row(args.preset, args.swarm_steps, "cpu", "float32", args.seed, args.swarm_timeout))
        for dtype in ("float32", "bfloat16"):
            rows.append(
                swarm_row(args.preset, args.swarm_steps, "cuda", dtype, args.seed, args.swarm_timeout)
                if cuda
                else Row("swarm", "cuda", dtype, None, None, 0.0, "skipped: no CUDA device")
            )
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"cuda": name, "rows": [r.__dict__ for r in rows]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
