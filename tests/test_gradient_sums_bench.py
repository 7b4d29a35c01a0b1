"""`benchmarks/gradient_sums.py` runs end to end and prints a row per way of summing, with its ratio."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gradient_sums.py"


def test_gradient_sums_benchmark_prints_every_row() -> None:
    argv = [sys.executable, str(SCRIPT), "--preset", "tiny", "--rounds", "1", "--groups", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    names = [row.split("|")[1].strip() for row in rows]
    assert names == ["bare", "float64 sums", "index order, in order", "index order, reversed"]
    assert rows[0].split("|")[3].strip() == "1.00"
    assert all(float(row.split("|")[3]) > 0 for row in rows)
