"""Links files and pacers: the 12-site file parses, bad fields are named, pacing follows the cost model."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

from protocols.errors import LocalProtocolError
from protocols.links import (
    GIB,
    MAX_LINK_COSTS,
    MAX_LINK_PEER_CHARS,
    MAX_LINK_SECONDS,
    MAX_PEERS,
    SAMPLES,
    TRUSTED_SAMPLES,
    Link,
    LinkEstimates,
    Pacer,
    loads_network,
    parse_network,
)

GCP12 = Path(__file__).parents[2] / "benchmarks" / "data" / "gcp12_links.json"
SMALL: dict[str, Any] = {
    "sites": ["A", "B", "C"],
    "same_site": {"latency_ms": 1, "bandwidth_GBps": 2.0},
    "links": [
        {"a": "A", "b": "B", "latency_ms": 100, "bandwidth_GBps": 0.5},
        {"a": "A", "b": "C", "latency_ms": 20, "bandwidth_GBps": 1},
        {"a": "C", "b": "B", "latency_ms": 50.5, "bandwidth_GBps": 0.25},
    ],
}


def test_the_twelve_sites_parse() -> None:
    data = json.loads(GCP12.read_text())
    network = loads_network(GCP12.read_text())
    assert network.sites == tuple(data["sites"]) and len(network.links) == 66
    first = data["links"][0]
    link = network.link(first["b"], first["a"])
    assert link == network.link(first["a"], first["b"])
    assert link.latency_s == first["latency_ms"] / 1000
    assert link.bandwidth_bytes_per_s == first["bandwidth_GBps"] * GIB
    assert network.link("Japan", "Japan") == Link(0.001, 2 * GIB)
    assert network.placement == {}


def test_transfer_time_is_latency_plus_bytes_over_bandwidth() -> None:
    link = parse_network(SMALL).link("B", "A")
    assert link.transfer_s(GIB) == pytest.approx(0.1 + 2.0)
    assert link.transfer_s(0) == pytest.approx(0.1)


def test_placement_then_round_robin() -> None:
    network = parse_network({**SMALL, "placement": {"s1r1": "C"}})
    assert network.place(["data1", "s1r1", "s2r1", "s3r1", "s4r1"]) == {
        "data1": "A",
        "s1r1": "C",
        "s2r1": "B",
        "s3r1": "C",
        "s4r1": "A",
    }
    with pytest.raises(LocalProtocolError, match="placement names 's1r1', not a node of this swarm"):
        network.place(["data1"])


def test_unknown_site_names_the_known_ones() -> None:
    network = parse_network(SMALL)
    assert network.check_site("B") == "B"
    with pytest.raises(LocalProtocolError, match="unknown site 'Mars'; the network's sites are A, B, C"):
        network.check_site("Mars")
    with pytest.raises(LocalProtocolError, match="unknown site 'Mars'"):
        network.link("A", "Mars")


def _broken(path: str, value: object) -> dict[str, Any]:
    data = copy.deepcopy(SMALL)
    *parents, last = path.split(".")
    target: Any = data
    for part in parents:
        target = target[int(part)] if isinstance(target, list) else target[part]
    if value is _DELETE:
        del target[int(last) if isinstance(target, list) else last]
    elif isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return data


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("sites", "A", r"network.sites must be a list"),
        ("sites", [], r"network.sites must be a list"),
        ("sites.1", 7, r"network.sites\[1\] must be a name"),
        ("sites.1", "", r"network.sites\[1\] must be a name"),
        ("sites.2", "A", r"network.sites names 'A' twice"),
        ("same_site", _DELETE, r"network.same_site must be a JSON object"),
        ("same_site.latency_ms", -1, r"network.same_site.latency_ms must be a number >= 0, got -1"),
        ("same_site.bandwidth_GBps", 0, r"network.same_site.bandwidth_GBps must be a positive number"),
        ("links", {}, r"network.links must be a list"),
        ("links.0", [], r"network.links\[0\] must be a JSON object"),
        ("links.1.b", "Mars", r"network.links\[1\].b: unknown site 'Mars'"),
        ("links.1.b", "A", r"network.links\[1\]: a and b are both 'A'"),
        ("links.2.a", "A", r"network.links\[2\]: a second link between A and B"),
        ("links.2", _DELETE, r"network.links: no link between B and C"),
        ("links.0.latency_ms", "100", r"network.links\[0\].latency_ms must be a number"),
        ("links.0.latency_ms", True, r"network.links\[0\].latency_ms must be a number"),
        ("links.0.bandwidth_GBps", math.inf, r"network.links\[0\].bandwidth_GBps must be a positive"),
        ("links.0.bandwidth_GBps", _DELETE, r"network.links\[0\].bandwidth_GBps must be a positive"),
        ("placement", ["A"], r"network.placement must be a JSON object"),
        ("placement", {"data1": "Mars"}, r"network.placement\['data1'\]: unknown site 'Mars'"),
    ],
)
def test_bad_fields_are_named(path: str, value: object, message: str) -> None:
    with pytest.raises(LocalProtocolError, match=message):
        parse_network(_broken(path, value))


def test_not_json_and_not_an_object() -> None:
    with pytest.raises(LocalProtocolError, match="network: not JSON"):
        loads_network("{")
    with pytest.raises(LocalProtocolError, match="network must be a JSON object"):
        loads_network("[]")


def test_pacer_delays_by_latency_and_paces_at_bandwidth() -> None:
    pacer = Pacer(Link(0.1, 1000.0))
    assert pacer.send(10.0, 0) == pytest.approx(10.1)
    assert pacer.send(10.0, 500) == pytest.approx(10.6)  # 0.5 s on the wire, then the latency
    assert pacer.send(10.0, 500) == pytest.approx(11.1)  # queued behind the first
    assert pacer.backlog_s(10.25) == pytest.approx(0.75)
    assert pacer.send(10.5, 0) == pytest.approx(11.1)  # a small message waits its turn too
    assert pacer.backlog_s(12.0) == 0.0
    assert pacer.send(20.0, 1000) == pytest.approx(21.1)  # an idle link starts at once


def test_pacer_refuses_bad_input() -> None:
    pacer = Pacer(Link(0.0, 1.0))
    with pytest.raises(LocalProtocolError, match="cannot have -1 bytes"):
        pacer.send(0.0, -1)
    with pytest.raises(LocalProtocolError, match="now must be finite"):
        pacer.send(math.nan, 1)
    with pytest.raises(LocalProtocolError, match="bandwidth must be positive"):
        Link(0.0, 0.0)


def test_estimates_take_the_fastest_recent_calls() -> None:
    estimates = LinkEstimates()
    assert estimates.send_s("far", 1 << 20) is None
    for seconds in (2.0, 0.21, 0.2):  # the first call met the peer starting: too few to tell yet
        estimates.observe("far", 100, 10, seconds)
    assert estimates.round_trip_s("far") is None and estimates.send_s("far", 1 << 20) is None
    estimates.observe("far", 100, 10, 5.0)  # one call waited on its peer: it does not count
    assert TRUSTED_SAMPLES == 4 and estimates.round_trip_s("far") == pytest.approx(0.2)
    assert estimates.send_s("far", 1 << 20) == pytest.approx(0.1)  # no large request timed yet
    for seconds in (9.0, 3.0, 1.0):  # 1 MiB in 1 s past the round trip, the others queued or starting
        estimates.observe("far", 1 << 20, 10, 0.2 + seconds)
    assert estimates.send_s("far", 1 << 19) == pytest.approx(0.1)  # three large requests: the trip alone
    estimates.observe("far", 1 << 20, 10, 0.2 + 3.0)
    assert estimates.send_s("far", 1 << 19) == pytest.approx(0.1 + 0.5)
    estimates.observe("far", 1 << 20, 1 << 20, 0.01)  # large both ways: neither kind
    assert estimates.send_s("far", 1 << 19) == pytest.approx(0.1 + 0.5)
    for _ in range(SAMPLES):  # the link got slower: once the fast samples are old, it shows
        estimates.observe("far", 100, 10, 0.4)
    assert estimates.round_trip_s("far") == pytest.approx(0.4)
    estimates.observe("near", 10, 10, 0.001)
    assert estimates.recent(5) == ["near", "far"] and estimates.recent(1) == ["near"]
    with pytest.raises(LocalProtocolError, match="cannot take"):
        estimates.observe("near", 10, 10, -1.0)


def test_a_record_carries_the_links_measured_last() -> None:
    estimates = LinkEstimates()
    for i in range(MAX_LINK_COSTS + 2):
        for _ in range(TRUSTED_SAMPLES):
            estimates.observe(f"peer{i}", 100, 10, 0.02)
    for _ in range(TRUSTED_SAMPLES):
        estimates.observe("far", 100, 10, 2 * MAX_LINK_SECONDS)  # capped at what a record may carry
        estimates.observe("x" * (MAX_LINK_PEER_CHARS + 1), 100, 10, 0.02)  # no peer id: left out
    costs = estimates.link_costs(hop_bytes=1 << 20)
    assert [c.peer for c in costs][:2] == ["far", f"peer{MAX_LINK_COSTS + 1}"]
    assert len(costs) == MAX_LINK_COSTS - 1  # the most recent MAX_LINK_COSTS, less the one too long
    assert costs[0].seconds == MAX_LINK_SECONDS and costs[1].seconds == pytest.approx(0.01)


def test_estimates_forget_the_least_recent_peers() -> None:
    estimates = LinkEstimates()
    for i in range(MAX_PEERS + 3):
        for _ in range(TRUSTED_SAMPLES):
            estimates.observe(f"peer{i}", 10, 10, 0.01)
    assert estimates.round_trip_s("peer0") is None and estimates.round_trip_s(f"peer{MAX_PEERS + 2}") == 0.01
    assert len(estimates.recent(10 * MAX_PEERS)) == MAX_PEERS


def test_a_peer_sent_only_hops_waits_for_a_round_trip() -> None:
    estimates = LinkEstimates()
    estimates.observe("next", 1 << 20, 10, 0.5)  # a hop: a large request, a small acknowledgement
    for _ in range(TRUSTED_SAMPLES):
        estimates.observe("near", 100, 10, 0.002)
    assert estimates.without_round_trip() == ["next"]
    assert [c.peer for c in estimates.link_costs(hop_bytes=1 << 20)] == ["near"]  # no cost for "next" yet
    for _ in range(TRUSTED_SAMPLES - 1):
        estimates.observe("next", 100, 10, 0.3)  # pings
    assert estimates.without_round_trip() == ["next"]  # too few yet
    estimates.observe("next", 100, 10, 0.3)
    assert estimates.without_round_trip() == []
    assert {c.peer for c in estimates.link_costs(hop_bytes=1 << 20)} == {"near", "next"}
