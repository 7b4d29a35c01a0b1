"""`swarmnode schedule`: a table, one JSON object, and one-line usage errors for bad scenario files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from protocols.skippipe import scenario_from_dict
from protocols.skippipe import schedule as plan_skippipe
from swarmnode.cli.schedule import schedule

SCENARIO = Path(__file__).parents[2] / "benchmarks" / "data" / "gcp12_links.json"
METHODS = {
    "full_pipeline",
    "skips_without_collision_awareness",
    "skippipe_without_collision_avoidance",
    "skippipe",
}


def test_table(tmp_path: Path) -> None:
    data = json.loads(SCENARIO.read_text())
    data["skippipe_reference_scenario"].update(
        nodes=8,
        node_sites=["Belgium", "Iowa", "NL", "Oregon", "London", "LA", "Germany", "Canada"],
        node_stages=[[0, 1], [2, 3], [4, 5], [6, 7]],
        microbatches_per_data_node=2,
    )
    small = tmp_path / "small.json"
    small.write_text(json.dumps(data))
    result = CliRunner().invoke(schedule, ["--scenario", str(small)])
    assert result.exit_code == 0, result.output
    assert "8 nodes, 2 data nodes x 2 microbatches, 3 of 3 stages per path, memory 3, seed 0" in result.output
    rows = {line.split("  ")[0] for line in result.output.splitlines()}
    assert {name.replace("_", " ") for name in METHODS} <= rows
    assert "skippipe scheduler:" in result.output


def test_json_is_one_object_with_paths_and_times() -> None:
    result = CliRunner().invoke(schedule, ["--scenario", str(SCENARIO), "--json", "--seed", "1"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    timing = {"scheduler_seconds", "scheduler_cpu_seconds", "event_loop"}
    assert set(out) == {"paths", "iteration_time_s", *timing}
    assert out["event_loop"] in ("c", "python")
    assert set(out["iteration_time_s"]) == METHODS
    assert out["iteration_time_s"]["skippipe"] < out["iteration_time_s"]["full_pipeline"]
    assert sorted(out["paths"], key=int) == [str(mb) for mb in range(30)]
    for path in out["paths"].values():
        assert path[0] == path[-1] and path[0] in (0, 3, 4, 10, 11) and len(path) == 5
    assert out["scheduler_seconds"] > 0
    assert out["scheduler_cpu_seconds"] > 0


@pytest.mark.parametrize(
    ("content", "needle"),
    [(None, "cannot read"), ("{not json", "not valid JSON"), ('{"sites": ["a"]}', "same_site")],
)
def test_bad_scenario_files_are_usage_errors(tmp_path: Path, content: str | None, needle: str) -> None:
    path = tmp_path / "scenario.json"
    if content is not None:
        path.write_text(content)
    result = CliRunner().invoke(schedule, ["--scenario", str(path)])
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and needle in errors[0] and "--scenario" in errors[0]
    assert "Traceback" not in result.output


def test_planner_effort_options_reach_the_planner() -> None:
    args = ["--scenario", str(SCENARIO), "--json", "--restarts", "1", "--rounds", "0"]
    result = CliRunner().invoke(schedule, args)
    assert result.exit_code == 0, result.output
    scenario = scenario_from_dict(json.loads(SCENARIO.read_text()))
    quick = plan_skippipe(scenario.view, scenario.rules, 0, restarts=1, rounds=0)
    assert json.loads(result.output)["paths"] == quick.as_dict()
    assert CliRunner().invoke(schedule, ["--scenario", str(SCENARIO), "--restarts", "0"]).exit_code == 2
