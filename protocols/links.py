"""Emulated network links: a links file parsed into a `Network`, and a `Pacer` per directed site pair.

A links file (the format of `gcp12_links.json`) is a JSON object with `sites` (distinct names), `links`
(one per pair of different sites: `a`, `b`, one-way `latency_ms`, `bandwidth_GBps` in GiB/s; symmetric),
`same_site` (`latency_ms`, `bandwidth_GBps` between two nodes of one site) and optionally `placement`
(launcher node names such as `data1` or `s2r1` -> site). Other keys are ignored. Sending B bytes over a
link takes `latency_ms / 1000 + B / (bandwidth_GBps * 2**30)` seconds, as in the SkipPipe paper's cost model.

A `Pacer` is one direction of one link: messages leave in the order they are handed to it, each taking the
link for `B / bandwidth` seconds after the previous one left, and arrive one latency later. Time is passed in.

`LinkEstimates` is the other side: what a node learns of its links to its peers from its own calls (round
trips of small calls, seconds per byte of large requests), the least of recent samples: waiting (on a busy
peer, a queue, a loaded CPU) only ever adds to a call's time, so the fastest recent call is the best
measure of the link itself, and one slow call does not make a link look slow.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from protocols._schema import Schema, checked, number, text
from protocols.errors import LocalProtocolError

GIB = 2**30
MAX_SITES = 1024
MAX_SITE_CHARS = 128
MAX_LINK_COSTS = 16  # measured links a node record carries (its node's most recently used)
MAX_LINK_PEER_CHARS = 64  # a peer id in base58 (52 characters for an Ed25519 key)
MAX_LINK_SECONDS = 600.0
SMALL_CALL_BYTES = 16 << 10  # a call whose request and reply together are this small times a round trip
LARGE_REQUEST_BYTES = 64 << 10  # a request this large (with a small reply) times the link's bandwidth
SAMPLES = 16  # recent samples kept per peer and kind
TRUSTED_SAMPLES = 4  # samples of a kind before its least counts (the first calls to a peer meet it starting)
MAX_PEERS = 256  # peers remembered (the least recently measured forgotten first)


@dataclass(frozen=True)
class Link:
    """One link, the same both ways: one-way latency (seconds) and bandwidth (bytes per second)."""

    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise LocalProtocolError(f"a link's latency must be finite and >= 0, got {self.latency_s!r}")
        if not (math.isfinite(self.bandwidth_bytes_per_s) and self.bandwidth_bytes_per_s > 0):
            bandwidth = self.bandwidth_bytes_per_s
            raise LocalProtocolError(f"a link's bandwidth must be positive, got {bandwidth!r}")

    def transfer_s(self, nbytes: int) -> float:
        """Seconds from handing `nbytes` to an idle link to their arrival."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Network:
    """Sites, the link between every two of them, the link within a site, and a placement of named nodes."""

    sites: tuple[str, ...]
    same_site: Link
    links: Mapping[frozenset[str], Link]
    placement: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        object.__setattr__(self, "links", MappingProxyType(dict(self.links)))
        object.__setattr__(self, "placement", MappingProxyType(dict(self.placement)))

    def check_site(self, site: str) -> str:
        """`site` if it is one of the network's; raises LocalProtocolError naming the known sites."""
        if site not in self.sites:
            known = ", ".join(self.sites)
            raise LocalProtocolError(f"unknown site {site!r}; the network's sites are {known}")
        return site

    def link(self, a: str, b: str) -> Link:
        """The link from site `a` to site `b` (`same_site` when they are one)."""
        if a == b:
            self.check_site(a)
            return self.same_site
        link = self.links.get(frozenset((a, b)))
        if link is None:
            self.check_site(a)
            self.check_site(b)
            raise LocalProtocolError(f"no link between {a} and {b}")
        return link

    def place(self, names: Sequence[str]) -> dict[str, str]:
        """Sites for the nodes `names`: the placement map's, the rest round robin over `sites` in order.

        Raises LocalProtocolError if the placement names a node not among `names`."""
        unknown = sorted(set(self.placement) - set(names))
        if unknown:
            raise LocalProtocolError(
                f"network.placement names {unknown[0]!r}, not a node of this swarm ({', '.join(names)})"
            )
        rest = [name for name in names if name not in self.placement]
        placed = {name: self.sites[i % len(self.sites)] for i, name in enumerate(rest)}
        return {name: self.placement.get(name) or placed[name] for name in names}


class Pacer:
    """One direction of one link: when each message handed to it arrives (FIFO, one message at a time)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self._free_at = -math.inf  # when the link finishes sending what it was handed so far

    def send(self, now: float, nbytes: int) -> float:
        """Hand `nbytes` to the link at time `now`; returns when they arrive (same clock as `now`)."""
        if not math.isfinite(now):
            raise LocalProtocolError(f"now must be finite, got {now!r}")
        if nbytes < 0:
            raise LocalProtocolError(f"a message cannot have {nbytes} bytes")
        self._free_at = max(now, self._free_at) + nbytes / self.link.bandwidth_bytes_per_s
        return self._free_at + self.link.latency_s

    def backlog_s(self, now: float) -> float:
        """Seconds of sending still queued at `now` (0 when the link is idle)."""
        return max(0.0, self._free_at - now)


@dataclass(frozen=True)
class LinkCost(Schema):
    """A node's measured seconds to send one microbatch's activations to `peer` (`NodeRecord.links`)."""

    peer: str = field(metadata=checked(text(MAX_LINK_PEER_CHARS, 1)))
    seconds: float = field(metadata=checked(number(0.0, MAX_LINK_SECONDS)))


class LinkEstimates:
    """Per peer, the least of recent round trips (small calls) and seconds per byte (large requests)."""

    def __init__(self) -> None:
        self._rtt: OrderedDict[str, deque[float]] = OrderedDict()  # least recently measured first
        self._per_byte: dict[str, deque[float]] = {}

    def observe(self, peer: str, sent: int, received: int, seconds: float) -> None:
        """A call to `peer` that sent `sent` bytes and received `received` in `seconds`, end to end."""
        if not (math.isfinite(seconds) and seconds >= 0) or min(sent, received) < 0:
            raise LocalProtocolError(f"a call of {sent}+{received} bytes cannot take {seconds!r} s")
        if sent + received <= SMALL_CALL_BYTES:
            self._rtt.setdefault(peer, deque(maxlen=SAMPLES)).append(seconds)
        elif sent >= LARGE_REQUEST_BYTES and received <= SMALL_CALL_BYTES:
            rtt = min(self._rtt.get(peer) or (0.0,))
            per_byte = self._per_byte.setdefault(peer, deque(maxlen=SAMPLES))
            per_byte.append(max(0.0, seconds - rtt) / sent)
        else:
            return
        if peer in self._rtt:
            self._rtt.move_to_end(peer)
        while len(self._rtt) > MAX_PEERS:
            oldest, _ = self._rtt.popitem(last=False)
            self._per_byte.pop(oldest, None)
        if len(self._per_byte) > MAX_PEERS:  # peers only ever sent large requests
            self._per_byte.pop(next(iter(self._per_byte)))

    def round_trip_s(self, peer: str) -> float | None:
        """The least of the recent round trips to `peer`; None before `TRUSTED_SAMPLES` of them.

        The first calls to a peer meet it (or this node) starting: importing, building its model, taking
        its first microbatches. In fresh local swarms on a loaded 2-core machine, links timed by one or
        two such calls made two replicas of a stage up to a second apart in mean link cost, where later
        reads had them within a tenth of one, and the deal of microbatches between replicas
        (`protocols.skippipe.mix_replicas`) followed those first timings."""
        samples = self._rtt.get(peer)
        return min(samples) if samples and len(samples) >= TRUSTED_SAMPLES else None

    def send_s(self, peer: str, nbytes: int) -> float | None:
        """Seconds to deliver `nbytes` to `peer`: half a round trip plus the bytes at the measured rate
        (the round trip alone until `TRUSTED_SAMPLES` large requests were timed); None until the round
        trip is known (`round_trip_s`)."""
        rtt = self.round_trip_s(peer)
        if rtt is None:
            return None
        per_byte = self._per_byte.get(peer)
        trusted = per_byte is not None and len(per_byte) >= TRUSTED_SAMPLES
        return rtt / 2 + (nbytes * min(per_byte) if trusted else 0.0)

    def without_round_trip(self) -> list[str]:
        """Peers this node sent large requests to (hops) but has not timed enough small calls with
        (`round_trip_s`): their links cost nothing in `link_costs` until pings give a round trip."""
        return [peer for peer in self._per_byte if self.round_trip_s(peer) is None]

    def recent(self, count: int) -> list[str]:
        """The `count` peers with a round trip measured most recently, most recent first."""
        return list(reversed(self._rtt))[:count]

    def link_costs(self, hop_bytes: int) -> tuple[LinkCost, ...]:
        """What a node record carries of these estimates (`NodeRecord.links`): for the `MAX_LINK_COSTS`
        peers measured last, the seconds `hop_bytes` take to reach each (the planners' link costs)."""
        costs = []
        for peer in self.recent(MAX_LINK_COSTS):
            seconds = self.send_s(peer, hop_bytes)
            if seconds is not None and len(peer) <= MAX_LINK_PEER_CHARS:
                costs.append(LinkCost(peer, min(seconds, MAX_LINK_SECONDS)))
        return tuple(costs)


def loads_network(text: str | bytes) -> Network:
    """A network from the text of a links file; raises LocalProtocolError naming what is wrong."""
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise LocalProtocolError(f"network: not JSON ({e})") from None
    return parse_network(data)


def parse_network(data: object) -> Network:
    """A network from a parsed links file; raises LocalProtocolError naming the first bad field."""
    top = _mapping(data, "network")
    raw_sites = top.get("sites")
    if not isinstance(raw_sites, list) or not 1 <= len(raw_sites) <= MAX_SITES:
        raise LocalProtocolError(f"network.sites must be a list of 1 to {MAX_SITES} site names")
    sites = tuple(_site(site, f"network.sites[{i}]") for i, site in enumerate(raw_sites))
    if len(set(sites)) != len(sites):
        duplicate = next(site for site in sites if sites.count(site) > 1)
        raise LocalProtocolError(f"network.sites names {duplicate!r} twice")
    same_site = _link(top.get("same_site"), "network.same_site")
    links: dict[frozenset[str], Link] = {}
    raw_links = top.get("links")
    if not isinstance(raw_links, list):
        raise LocalProtocolError("network.links must be a list")
    for i, raw in enumerate(raw_links):
        where = f"network.links[{i}]"
        entry = _mapping(raw, where)
        a, b = (_known(entry.get(end), sites, f"{where}.{end}") for end in ("a", "b"))
        if a == b:
            raise LocalProtocolError(f"{where}: a and b are both {a!r}; same_site covers a site with itself")
        if frozenset((a, b)) in links:
            raise LocalProtocolError(f"{where}: a second link between {a} and {b}")
        links[frozenset((a, b))] = _link(entry, where)
    for i, a in enumerate(sites):
        for b in sites[i + 1 :]:
            if frozenset((a, b)) not in links:
                raise LocalProtocolError(f"network.links: no link between {a} and {b}")
    placement = _mapping(top.get("placement", {}), "network.placement")
    for name, site in placement.items():
        _site(name, "network.placement: a node name")
        _known(site, sites, f"network.placement[{name!r}]")
    return Network(sites, same_site, links, placement)


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise LocalProtocolError(f"{where} must be a JSON object")
    return value


def _site(value: object, where: str) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_SITE_CHARS:
        raise LocalProtocolError(f"{where} must be a name of 1 to {MAX_SITE_CHARS} characters, got {value!r}")
    return value


def _known(value: object, sites: tuple[str, ...], where: str) -> str:
    if value not in sites:
        raise LocalProtocolError(f"{where}: unknown site {value!r}")
    return str(value)


def _link(raw: object, where: str) -> Link:
    entry = _mapping(raw, where)
    latency, bandwidth = entry.get("latency_ms"), entry.get("bandwidth_GBps")
    if not _number(latency) or latency < 0:
        raise LocalProtocolError(f"{where}.latency_ms must be a number >= 0, got {latency!r}")
    if not _number(bandwidth) or bandwidth <= 0:
        raise LocalProtocolError(f"{where}.bandwidth_GBps must be a positive number, got {bandwidth!r}")
    return Link(latency / 1000, bandwidth * GIB)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
