"""`--network` and `--site` on `join` and `up`: bad links files, unknown sites and missing halves are one-line
usage errors naming the option and what is wrong; a good file places `up`'s nodes and reaches the daemons."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import one_line_usage_error, run
from click.testing import CliRunner

from swarmnode.cli import up as up_module
from swarmnode.launcher import SwarmConfig, SwarmResult

GCP12 = Path(__file__).parents[1] / "benchmarks" / "data" / "gcp12_links.json"
TWO_SITES: dict[str, Any] = {
    "sites": ["A", "B"],
    "same_site": {"latency_ms": 1, "bandwidth_GBps": 2},
    "links": [{"a": "A", "b": "B", "latency_ms": 50, "bandwidth_GBps": 0.1}],
}


def links_file(tmp_path: Path, data: object, name: str = "links.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_join_refuses_bad_files_and_sites(tmp_path: Path) -> None:
    good = str(links_file(tmp_path, TWO_SITES))
    join = ("join", "--stage", "1")
    one_line_usage_error(
        *run(*join, "--network", good, "--site", "Mars"), "--site", "unknown site 'Mars'", "A, B"
    )
    one_line_usage_error(*run(*join, "--network", good), "--network", "needs --site")
    one_line_usage_error(*run(*join, "--site", "A"), "--site", "needs --network")
    missing = tmp_path / "none.json"
    one_line_usage_error(*run(*join, "--network", str(missing), "--site", "A"), "--network", "cannot read")
    broken = links_file(tmp_path, "{", "broken.json")
    one_line_usage_error(*run(*join, "--network", str(broken), "--site", "A"), "broken.json", "not JSON")
    zero = links_file(
        tmp_path, {**TWO_SITES, "same_site": {"latency_ms": 1, "bandwidth_GBps": 0}}, "zero.json"
    )
    one_line_usage_error(
        *run(*join, "--network", str(zero), "--site", "A"), "zero.json", "same_site.bandwidth_GBps"
    )


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[SwarmConfig]:
    """Stands in for the launcher: records the configs it was given."""
    monkeypatch.chdir(tmp_path)
    configs: list[SwarmConfig] = []

    class FakeSwarm:
        def __init__(self, config: SwarmConfig) -> None:
            configs.append(config)

        def run(self) -> SwarmResult:
            raise SystemExit(0)  # the summary is another test's

    monkeypatch.setattr(up_module, "LocalSwarm", FakeSwarm)
    return configs


def test_up_places_nodes_by_the_placement_then_round_robin(
    started: list[SwarmConfig], tmp_path: Path
) -> None:
    path = links_file(tmp_path, {**TWO_SITES, "placement": {"s2r1": "A", "data2": "A"}})
    result = CliRunner().invoke(
        up_module.up,
        ["--network", str(path), "--skip-ratio", "0.34", "--planner", "random_skips", "--stages", "3"],
    )
    assert result.exit_code == 0, result.output
    [config] = started
    assert config.skip_ratio == 0.34 and config.network == path
    assert dict(config.placement) == {
        "data1": "A",
        "data2": "A",
        "s1r1": "B",
        "s1r2": "A",
        "s2r1": "A",
        "s2r2": "B",
        "s3r1": "A",
        "s3r2": "B",
    }
    bootstrap = config.bootstrap_argv()
    assert bootstrap[bootstrap.index("--skip-ratio") + 1] == "0.34"
    assert bootstrap[bootstrap.index("--planner") + 1] == "random_skips" == config.settings()["planner"]
    assert bootstrap[bootstrap.index("--min-data-nodes") + 1] == str(config.data_nodes)  # they start together
    assert bootstrap[bootstrap.index("--min-replicas") + 1] == str(config.replicas)  # with every pipeline
    argv = config.join_argv(1, None, config.placement["s1r1"])
    assert argv[argv.index("--network") + 1] == str(path.resolve()) and argv[argv.index("--site") + 1] == "B"
    assert "--network" not in SwarmConfig().join_argv(1, None, "B")  # no network: no sites


def test_up_takes_the_twelve_sites(started: list[SwarmConfig]) -> None:
    result = CliRunner().invoke(up_module.up, ["--network", str(GCP12), "--calm"])
    assert result.exit_code == 0, result.output
    sites = json.loads(GCP12.read_text())["sites"]
    assert list(started[0].placement.values()) == sites[:8]


@pytest.mark.parametrize(
    ("data", "args", "expected"),
    [
        ({**TWO_SITES, "placement": {"data9": "A"}}, [], "placement names 'data9', not a node of this swarm"),
        ({**TWO_SITES, "placement": {"data1": "C"}}, [], "placement['data1']: unknown site 'C'"),
        ({**TWO_SITES, "links": []}, [], "no link between A and B"),
        (TWO_SITES, ["--skip-ratio", "1"], "Invalid value for '--skip-ratio'"),
        (TWO_SITES, ["--skip-ratio", "nan"], "'nan' is not a finite number"),
        (TWO_SITES, ["--planner", "random_skips"], "planner 'random_skips' picks the stages to skip"),
        (TWO_SITES, ["--planner", "random"], "Invalid value for '--planner'"),
    ],
)
def test_up_refuses_bad_networks(
    started: list[SwarmConfig], tmp_path: Path, data: dict[str, Any], args: list[str], expected: str
) -> None:
    path = links_file(tmp_path, data)
    result = CliRunner().invoke(up_module.up, ["--network", str(path), *args])
    one_line_usage_error(result.exit_code, result.output, expected)
    assert started == []
