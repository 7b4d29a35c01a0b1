"""`benchmarks/finite_check.py` runs end to end and prints a row per case and method, with its ratio."""

from __future__ import annotations

from benchmark_tables import table_rows


def test_finite_check_benchmark_prints_every_row() -> None:
    rows = table_rows("finite_check.py", "--preset", "tiny", "--rounds", "1", "--repeats", "1")
    cases = ["a stage's weights (a copy)", "phi and theta (NoLoCo)", "one hop's activations"]
    assert [(row[0], row[1]) for row in rows] == [
        (case, method) for case in cases for method in ("isfinite().all()", "all_finite")
    ]
    assert [row[3] for row in rows[::2]] == ["1.00"] * 3
    assert all(float(row[3]) > 0 for row in rows)
