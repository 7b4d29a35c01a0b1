"""The NoLoCo and SkipPipe reproduction scripts, each run end to end in smoke mode as a subprocess.

The figures of a smoke run are too short to judge a claim; these tests check the result's shape and the
relations that hold by construction whatever the noise: DiLoCo's replicas agree after its outer step, NoLoCo's
pairwise averaging keeps replicas closer than no synchronisation, the tree all-reduce is log2(8) measured
exchanges, SkipPipe paths honour the rules with half the stages each, the full pipeline never skips.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERDICTS = ("reproduced", "in shape", "not reproduced")


def _run(script: str, tmp_path: Path) -> dict:
    out, png = tmp_path / "result.json", tmp_path / "result.png"
    done = subprocess.run(
        [sys.executable, f"benchmarks/repro/{script}", "--smoke", "--json", str(out), "--plot", str(png)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard: a smoke run takes seconds of CPU, minutes on a loaded machine
    )
    if done.returncode != 0:
        pytest.fail(f"{script} failed:\n{done.stderr[-4000:]}")
    if png.stat().st_size == 0:
        pytest.fail("empty plot")
    body = json.loads(out.read_text())
    assert body["claim"] and body["verdict"].startswith(VERDICTS)
    for row in body["rows"]:
        assert set(row) == {"method", "metric", "seeds"}
        assert len(row["seeds"]) == 1 and all(math.isfinite(v) for v in row["seeds"])
    assert body["cpu_seconds"] > 0  # the run's CPU time, what its idle-machine time is estimated from
    return body


def _value(body: dict, method: str, metric: str) -> float:
    (row,) = [r for r in body["rows"] if r["method"] == method and r["metric"] == metric]
    return row["seeds"][0]


def test_noloco_vs_diloco_smoke(tmp_path: Path) -> None:
    body = _run("noloco_vs_diloco.py", tmp_path)
    assert body["replicas"] == 8
    spread = "relative weight spread"
    assert {r["method"] for r in body["rows"] if r["metric"] == spread} == {
        "data_parallel",
        "diloco",
        "noloco",
        "no_sync",
    }
    assert _value(body, "data_parallel", spread) == 0.0
    assert _value(body, "diloco", spread) < 1e-5  # the run ends on a DiLoCo outer step: replicas agree
    assert 0 < _value(body, "noloco", spread) < _value(body, "no_sync", spread)
    for method in ("data_parallel", "diloco"):
        averaged = _value(body, method, "val loss, averaged model")
        assert averaged == pytest.approx(_value(body, method, "val loss, mean of replicas"), abs=1e-4)
    for method in ("data_parallel", "diloco", "noloco", "no_sync"):
        assert 0 < _value(body, method, "val loss, averaged model") < 2 * math.log(1024)
    metric = "sync s/outer step, bench data stage"
    pairwise = _value(body, "noloco pairwise (measured)", metric)
    assert pairwise > 0
    assert _value(body, "tree all-reduce n=8", metric) == pytest.approx(3 * pairwise)
    assert body["sync"]["bench data stage"]["bytes_each_way"] > 0


def test_skippipe_quality_smoke(tmp_path: Path) -> None:
    body = _run("skippipe_quality.py", tmp_path)
    full, skip = body["paths"]["full_pipeline"][0], body["paths"]["skippipe_0.50"][0]
    assert full["stages_per_path"] == 6 and full["swapped_share"] == 0 and full["distinct_orders"] == 1
    assert skip["stages_per_path"] == 3 and skip["rule_violations"] == 0 and skip["distinct_orders"] > 1
    for method in ("full_pipeline", "skippipe_0.50"):
        every = _value(body, method, "val loss, all stages")
        half = _value(body, method, "val loss, half the stages skipped")
        increase = _value(body, method, "perplexity increase, half skipped (%)")
        assert increase == pytest.approx(100 * (math.exp(half - every) - 1))
