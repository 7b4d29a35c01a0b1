"""Relay addresses (`swarmnode.relays`) and the relay settings that reach p2pd: pure, no daemon."""

from __future__ import annotations

import pytest
from hivemind.p2p import P2P, PeerID

from swarmnode.dht import Reach
from swarmnode.hivemind_parts import p2pd_flags
from swarmnode.relays import MAX_RELAYS, circuit_addrs, relay_of, relays_of

RELAY = "12D3KooWLB7GnWgJsFc3uksAJCBTJxDhqtsokMd6zCUZ4NFCHqE2"
OTHER = "12D3KooWLsXarpt1a7Zm4HQdLGnxzZ7d3HwZHu46Ga3SW1Ae1v5o"
BOOT = f"/ip4/10.0.0.1/tcp/4000/p2p/{RELAY}"


def test_a_record_names_its_relays_by_circuit_address() -> None:
    (addr,) = circuit_addrs([BOOT])
    assert addr == f"{BOOT}/p2p-circuit"
    assert relay_of(addr) == PeerID.from_base58(RELAY)
    assert relay_of(f"/ip6/::1/tcp/4000/p2p/{RELAY}/p2p-circuit") == PeerID.from_base58(RELAY)


@pytest.mark.parametrize(
    "addr",
    [
        BOOT,  # no circuit
        "/ip4/10.0.0.1/tcp/4000/p2p-circuit",  # no relay id
        f"/dns/relay.example/tcp/4000/p2p/{RELAY}/p2p-circuit",  # a name to resolve
        f"/ip4/10.0.0.1/udp/4000/p2p/{RELAY}/p2p-circuit",
        f"/ip4/10.0.0.1/tcp/4000/tcp/5/p2p/{RELAY}/p2p-circuit",
        "/ip4/10.0.0.1/tcp/4000/p2p/notbase58!/p2p-circuit",
        "/ip4/999.0.0.1/tcp/4000/p2p-circuit",
        "nonsense/p2p-circuit",
        "",
    ],
)
def test_anything_else_a_record_lists_is_ignored(addr: str) -> None:
    assert relay_of(addr) is None
    assert relays_of([addr]) == ()


def test_a_record_yields_a_few_relays_without_repeats() -> None:
    many = [f"/ip4/10.0.0.{n}/tcp/4000/p2p/{RELAY if n % 2 else OTHER}" for n in range(1, 10)]
    assert relays_of(["junk", *circuit_addrs(many)]) == (PeerID.from_base58(RELAY), PeerID.from_base58(OTHER))
    distinct = [f"/ip4/10.0.0.1/tcp/4000/p2p/{peer}" for peer in (RELAY, OTHER)] * 3
    assert len(relays_of(circuit_addrs(distinct))) == 2 <= MAX_RELAYS


def test_static_relays_turn_discovery_off_in_p2pd() -> None:
    assert Reach().static_relays([BOOT]) == () and Reach().p2pd_flags([BOOT]) == {}
    natted = Reach(use_auto_relay=True, reachability="private")
    assert natted.static_relays([BOOT]) == (BOOT,)
    assert natted.p2pd_flags([BOOT]) == {"relayDiscovery": False}
    assert natted.p2pd_flags([]) == {}  # no relay known: libp2p discovers them
    other = f"/ip4/10.0.0.2/tcp/4000/p2p/{OTHER}"
    assert Reach(use_auto_relay=True, relays=(other,)).static_relays([BOOT]) == (other,)


def test_p2pd_flags_reach_the_argv_only_inside_the_block() -> None:
    before = P2P._make_process_args("p2pd", autoRelay=True)
    with p2pd_flags({"relayDiscovery": False}):
        assert P2P._make_process_args("p2pd", autoRelay=True) == [*before, "-relayDiscovery=0"]
    assert P2P._make_process_args("p2pd", autoRelay=True) == before == ["p2pd", "-autoRelay=1"]
    with pytest.raises(RuntimeError), p2pd_flags({"relayDiscovery": False}):
        raise RuntimeError("a failed start")
    assert P2P._make_process_args("p2pd", autoRelay=True) == before
    with p2pd_flags({}):
        assert P2P._make_process_args("p2pd", autoRelay=True) == before
