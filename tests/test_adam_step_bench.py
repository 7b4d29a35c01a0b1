"""`benchmarks/adam_step.py` runs end to end and prints a row per step and Adam path, with its ratio."""

from __future__ import annotations

from benchmark_tables import table_rows


def test_adam_step_benchmark_prints_every_row() -> None:
    rows = table_rows("adam_step.py", "--preset", "tiny", "--rounds", "1", "--steps", "1")
    assert [row[0] for row in rows] == [
        "stage step, foreach",
        "Adam alone, foreach",
        "stage step, fused",
        "Adam alone, fused",
    ]
    assert [row[2] for row in rows[:2]] == ["1.00", "1.00"]
    assert all(float(row[2]) > 0 for row in rows)
