"""`benchmarks/gradient_sums.py` runs end to end and prints a row per way of summing, with its ratio."""

from __future__ import annotations

from benchmark_tables import table_rows


def test_gradient_sums_benchmark_prints_every_row() -> None:
    rows = table_rows("gradient_sums.py", "--preset", "tiny", "--rounds", "1", "--groups", "1")
    names = [row[0] for row in rows]
    assert names == ["bare", "float64 sums", "index order, in order", "index order, reversed"]
    assert rows[0][2] == "1.00"
    assert all(float(row[2]) > 0 for row in rows)
