"""SkipPipe scenarios: the reference setting from gcp12_links.json, and clear errors on malformed input."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from protocols.errors import LocalProtocolError
from protocols.skippipe import scenario_from_dict

SCENARIO = Path(__file__).parents[2] / "benchmarks" / "data" / "gcp12_links.json"
DATA = json.loads(SCENARIO.read_text())


def test_reference_scenario() -> None:
    scenario = scenario_from_dict(DATA)
    view, rules = scenario.view, scenario.rules
    assert [len(stage) for stage in view.stages] == [5, 3, 3, 3, 3, 3]
    assert view.data_nodes == (0, 3, 4, 10, 11)
    assert view.forward_s == pytest.approx([0.055 * 4 * 8] * 20)
    # Belgium -> Germany and a same-site hop, as in the reference repository's committed delays.
    assert view.link_s[0][2] == pytest.approx(0.4828668089306232, abs=1e-4)
    assert view.link_s[0][12] == pytest.approx(0.3666251005828381, abs=1e-4)
    assert view.link_s[6][10] > 100  # NL -> London as published
    assert (rules.stages_per_path(view.n_stages), rules.memory, rules.microbatches_per_data_node) == (3, 3, 6)
    assert scenario.node_sites[11] == "Australia"
    assert scenario.published_s["skippipe"] == 33.3


def test_bandwidth_override() -> None:
    fixed = scenario_from_dict(DATA, bandwidth_overrides={("London", "NL"): 0.2368})
    assert fixed.view.link_s[6][10] < 1
    with pytest.raises(LocalProtocolError, match="override"):
        scenario_from_dict(DATA, bandwidth_overrides={("NL", "Mars"): 1.0})


def mutated(path: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(DATA)
    *parents, last = path.split(".")
    target = data
    for key in parents:
        target = target[int(key)] if isinstance(target, list) else target[key]
    if value is KeyError:
        del target[last]
    elif isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        ("sites", "Belgium", "sites"),
        ("same_site", KeyError, "same_site"),
        ("compute_s_per_sample_per_layer", -1, "compute_s_per_sample_per_layer"),
        ("links.0.bandwidth_GBps", 0, "bandwidth_GBps"),
        ("links.0.a", "Mars", "links[0]"),
        ("links.3", {"a": "Australia", "b": "Australia", "latency_ms": 1, "bandwidth_GBps": 1}, "links[3]"),
        ("skippipe_reference_scenario", KeyError, "skippipe_reference_scenario"),
        ("skippipe_reference_scenario.nodes", 21, "21 nodes"),
        ("skippipe_reference_scenario.node_sites.0", "Atlantis", "Atlantis"),
        ("skippipe_reference_scenario.node_stages.0", 0, "node_stages"),
        ("skippipe_reference_scenario.node_stages.1.0", 99, "node"),
        ("skippipe_reference_scenario.node_memory_microbatches", 0, "node_memory_microbatches"),
        ("skippipe_reference_scenario.samples_per_microbatch", "8", "samples_per_microbatch"),
        ("skippipe_reference_scenario.stages_visited_per_path_including_stage0", 9, "visit"),
        ("skippipe_reference_scenario.published_iteration_time_s", [], "published"),
    ],
)
def test_malformed_scenarios_name_the_field(path: str, value: Any, needle: str) -> None:
    with pytest.raises(LocalProtocolError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        scenario_from_dict(mutated(path, value))


def test_a_missing_link_is_named() -> None:
    data = copy.deepcopy(DATA)
    data["links"] = [link for link in data["links"] if {link["a"], link["b"]} != {"Japan", "Taiwan"}]
    with pytest.raises(LocalProtocolError, match="between Japan and Taiwan"):
        scenario_from_dict(data)


def test_not_a_mapping() -> None:
    with pytest.raises(LocalProtocolError, match="JSON object"):
        scenario_from_dict([])  # type: ignore[arg-type]
