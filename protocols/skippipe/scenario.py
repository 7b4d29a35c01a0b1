"""A SwarmView and PathRules from a scenario in the `gcp12_links.json` format (already parsed JSON).

Link cost of one hop between nodes at sites a and b: `latency_ms / 1000 + activation_bytes /
(bandwidth_GBps * 2**30) + per_hop_overhead_s` (the `same_site` figures when a == b), with activation
bytes = samples x seq_len x dim x 4 (fp32). Forward time of every node = compute_s_per_sample_per_layer x
layers_per_stage x samples_per_microbatch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from protocols.errors import LocalProtocolError
from protocols.skippipe.rules import PathRules
from protocols.skippipe.swarm import SwarmView

_REFERENCE = "skippipe_reference_scenario"


@dataclass(frozen=True)
class Scenario:
    """A swarm to plan for, its rules, where each node sits, and published iteration times (if any)."""

    view: SwarmView
    rules: PathRules
    node_sites: tuple[str, ...]
    published_s: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))


def scenario_from_dict(
    data: Mapping[str, Any], *, bandwidth_overrides: Mapping[tuple[str, str], float] | None = None
) -> Scenario:
    """Build the reference scenario of `data`; `bandwidth_overrides` replaces the GiB/s of site pairs.

    Raises LocalProtocolError naming the first malformed or missing field.
    """
    top = _mapping(data, "scenario")
    sites = _list(top, "sites", "scenario")
    if not all(isinstance(site, str) for site in sites) or len(set(sites)) != len(sites):
        raise LocalProtocolError("scenario: sites must be distinct strings")
    same = _mapping(top.get("same_site"), "scenario.same_site")
    same_link = (
        _number(same, "latency_ms", "scenario.same_site"),
        _positive(same, "bandwidth_GBps", "scenario.same_site"),
    )
    links = _links(top, set(sites))
    for (a, b), bandwidth in (bandwidth_overrides or {}).items():
        if frozenset((a, b)) not in links or not bandwidth > 0:
            raise LocalProtocolError(f"bandwidth override {a}-{b}: no such link or not a positive bandwidth")
        links[frozenset((a, b))] = (links[frozenset((a, b))][0], bandwidth)
    compute = _positive(top, "compute_s_per_sample_per_layer", "scenario")

    where = f"scenario.{_REFERENCE}"
    ref = _mapping(top.get(_REFERENCE), where)
    node_sites = _list(ref, "node_sites", where)
    for site in node_sites:
        if site not in sites:
            raise LocalProtocolError(f"{where}.node_sites: unknown site {site!r}")
    n = _count(ref, "nodes", where)
    if n != len(node_sites):
        raise LocalProtocolError(f"{where}: {n} nodes but {len(node_sites)} node_sites")
    stages = _list(ref, "node_stages", where)
    if not all(isinstance(stage, list) for stage in stages):
        raise LocalProtocolError(f"{where}.node_stages must be a list of lists of node ids")
    samples = _count(ref, "samples_per_microbatch", where)
    activation = samples * _count(ref, "seq_len", where) * _count(ref, "dim", where) * 4
    overhead = _number(ref, "per_hop_overhead_s", where)

    def cost(a: int, b: int) -> float:
        pair = frozenset((node_sites[a], node_sites[b]))
        latency_ms, bandwidth = same_link if len(pair) == 1 else links[pair]
        return latency_ms / 1000 + activation / (bandwidth * 2**30) + overhead

    forward = compute * _count(ref, "layers_per_stage", where) * samples
    view = SwarmView.build(stages, [forward] * n, cost)
    rules = PathRules.visiting(
        _count(ref, "stages_visited_per_path_including_stage0", where),
        len(view.stages),
        microbatches_per_data_node=_count(ref, "microbatches_per_data_node", where),
        memory=_count(ref, "node_memory_microbatches", where),
    )
    published = _mapping(ref.get("published_iteration_time_s", {}), f"{where}.published_iteration_time_s")
    times = {str(name): _number(published, name, f"{where}.published_iteration_time_s") for name in published}
    return Scenario(view, rules, tuple(node_sites), MappingProxyType(times))


def _links(top: Mapping[str, Any], sites: set[str]) -> dict[frozenset[str], tuple[float, float]]:
    links = {}
    for i, link in enumerate(_list(top, "links", "scenario")):
        where = f"scenario.links[{i}]"
        link = _mapping(link, where)
        a, b = link.get("a"), link.get("b")
        if a not in sites or b not in sites or a == b:
            raise LocalProtocolError(f"{where}: a and b must be two different known sites, got {a!r}, {b!r}")
        links[frozenset((a, b))] = (
            _number(link, "latency_ms", where),
            _positive(link, "bandwidth_GBps", where),
        )
    missing = [
        (a, b) for a in sorted(sites) for b in sorted(sites) if a < b and frozenset((a, b)) not in links
    ]
    if missing:
        raise LocalProtocolError(f"scenario.links: no link between {missing[0][0]} and {missing[0][1]}")
    return links


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise LocalProtocolError(f"{where} must be a JSON object")
    return value


def _list(obj: Mapping[str, Any], key: str, where: str) -> list[Any]:
    value = obj.get(key)
    if not isinstance(value, list):
        raise LocalProtocolError(f"{where}.{key} must be a list")
    return value


def _number(obj: Mapping[str, Any], key: str, where: str) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise LocalProtocolError(f"{where}.{key} must be a non-negative number, got {value!r}")
    return float(value)


def _positive(obj: Mapping[str, Any], key: str, where: str) -> float:
    value = _number(obj, key, where)
    if value == 0:
        raise LocalProtocolError(f"{where}.{key} must be positive")
    return value


def _count(obj: Mapping[str, Any], key: str, where: str) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LocalProtocolError(f"{where}.{key} must be a positive integer, got {value!r}")
    return value
