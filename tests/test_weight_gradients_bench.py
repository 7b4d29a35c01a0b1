"""`benchmarks/weight_gradients.py` runs end to end and prints a row per thread count and token count, with
both ways' times and their ratio."""

from __future__ import annotations

from benchmark_tables import table_rows


def test_weight_gradients_benchmark_prints_every_row() -> None:
    rows = table_rows(
        "weight_gradients.py", "--preset", "tiny", "--tokens", "16,64", "--threads", "1", "--rounds", "1"
    )
    assert [(row[0], row[1]) for row in rows] == [("1", "16"), ("1", "64")]
    assert all(float(cell) > 0 for row in rows for cell in row[2:])
