"""Run a benchmark script of `benchmarks/` and read the rows of the markdown table it prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def table_rows(script: str, *args: str) -> list[list[str]]:
    """The cells of each body row of the table `benchmarks/{script}` prints (the header and rule left out);
    fails the test if the script does not end cleanly within 300 s."""
    argv = [sys.executable, str(BENCHMARKS / script), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines]
