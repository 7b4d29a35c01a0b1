"""`benchmarks/gpu_check.py` runs end to end on this machine: its CPU rows train, and its CUDA rows run
where CUDA is present or say that they were skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"


def test_gpu_check_trainer_rows(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    argv = [
        sys.executable,
        str(SCRIPT),
        "--no-swarm",
        "--steps",
        "2",
        "--eval-batches",
        "1",
        "--json",
        str(out),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kind"], r["device"], r["dtype"]) for r in rows] == [
        ("train", "cpu", "float32"),
        ("train", "cuda", "float32"),
        ("train", "cuda", "bfloat16"),
        ("train", "cuda", "float16"),
    ]
    assert rows[0]["tokens_per_second"] > 0 and rows[0]["val_loss"] < 9.0
    for row in rows[1:]:
        if torch.cuda.is_available():
            assert row["tokens_per_second"] > 0 and row["val_loss"] < 9.0, row
        else:
            assert row["note"] == "skipped: no CUDA device" and row["tokens_per_second"] is None
    assert "x cpu" in done.stdout and "1.00" in done.stdout
