"""The reachability check on loopback, between real DHT peers (each with its p2pd): the answer, the
volunteer's line and event, hostile askers, and the options that reach hivemind."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Iterator

import msgpack
import pytest
from cli_helpers import one_line_usage_error, run
from hivemind.p2p import P2P, PeerID
from swarm_harness import event_objects

from protocols.messages import PROTOCOL_VERSION
from swarmnode.dht import Reach, SwarmDHT, peer_ids_of
from swarmnode.node.reachability import (
    PROTOCOL,
    ReachResult,
    ReachServer,
    check_reachability,
    describe,
    libp2p_answers,
    ports_to_check,
    report_reachability,
)

PEER = "12D3KooWLB7GnWgJsFc3uksAJCBTJxDhqtsokMd6zCUZ4NFCHqE2"


@pytest.fixture
def pair() -> Iterator[tuple[SwarmDHT, SwarmDHT]]:
    """A checking peer (`server`, which serves checks once started) and a node joined through it."""
    server = SwarmDHT("reach")
    node = SwarmDHT("reach", server.visible_maddrs())
    try:
        yield server, node
    finally:
        node.shutdown()
        server.shutdown()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def hostile_requests(port: int) -> list[bytes]:
    wire = {"v": PROTOCOL_VERSION, "kind": "reach_request"}
    attacks = [
        struct.pack(">H", 65535) + b"\x00" * 64,  # announces more than a request may hold
        struct.pack(">H", 3) + b"\xc1\xc1\xc1",  # not msgpack
        struct.pack(">H", 1),  # ends early
    ]
    for fields in ({"ports": [port] * 5}, {"ports": [0]}, {"observed": "x", "reachable": []}, {"ports": "x"}):
        body = msgpack.packb({**wire, **fields})
        attacks.append(struct.pack(">H", len(body)) + body)
    return attacks


async def _send(p2p: P2P, peer: PeerID, data: bytes) -> bytes:
    """Send `data` on a check stream and read until the server closes it."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer, PROTOCOL)
    try:
        with contextlib.suppress(ConnectionError):  # the server may close before reading it all
            writer.write(data)
            await writer.drain()
            writer.write_eof()  # a request that ends early ends here
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def test_the_check_between_peers_on_loopback(
    pair: tuple[SwarmDHT, SwarmDHT], capsys: pytest.CaptureFixture[str]
) -> None:
    """Unknown while the peer serves no checks; then reachable at the listening port (line on stderr, event on
    stdout); not reachable at a port nobody answers on; hostile askers get no answer and cost no check."""
    server, node = pair
    ports = ports_to_check(node)
    closed = closed_port()
    peer = PeerID.from_base58(server.peer_id)

    async def main() -> tuple[ReachResult, ReachResult, ReachResult, list[bytes], ReachResult, int]:
        mine = await node.replicate_p2p()
        unknown = await check_reachability(mine, [peer], ports)
        checks = ReachServer()
        await checks.start(await server.replicate_p2p())
        reported = await report_reachability(node, [peer])
        shut = await check_reachability(mine, [peer], (closed,))
        answers = [await _send(mine, peer, data) for data in hostile_requests(ports[0])]
        again = await check_reachability(mine, [peer], ports)
        await node.close()
        await server.close()
        return unknown, reported, shut, answers, again, checks.checks

    unknown, reported, shut, answers, again, checks = asyncio.run(main())
    assert unknown.reachable is None and unknown.checked_by is None
    assert describe(unknown, Reach()).startswith("reachability unknown")

    assert reported == ReachResult(ports, server.peer_id, "127.0.0.1", ports) == again
    out, err = capsys.readouterr()
    (event,) = event_objects(out.strip().splitlines()[-1:], "the reachability check", "reachability")
    assert event["reachable"] is True
    assert event["address"] == f"/ip4/127.0.0.1/tcp/{ports[0]}"
    assert err.strip().splitlines()[-1] == f"swarmnode: {event['message']}"
    assert event["message"].startswith(f"reachable at /ip4/127.0.0.1/tcp/{ports[0]}")

    assert (shut.reachable, shut.open_ports, shut.observed) == (False, (), "127.0.0.1")
    line = describe(shut, Reach())
    assert line.startswith(
        f"not reachable from the swarm: peer {server.peer_id} could not connect to 127.0.0.1:"
    )
    assert f"open TCP port {closed}" in line and "--announce-maddrs" in line and "--use-auto-relay" in line

    assert answers == [b""] * len(answers)  # closed without a reply
    assert checks == 3  # the three honest checks only


def test_a_listener_that_is_not_libp2p_does_not_count() -> None:
    async def main() -> bool:
        async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"SSH-2.0-OpenSSH_9.6\r\n")
            await writer.drain()
            writer.close()

        listener = await asyncio.start_server(greet, "127.0.0.1", 0)
        async with listener:
            return await libp2p_answers("127.0.0.1", listener.sockets[0].getsockname()[1], timeout=2.0)

    assert asyncio.run(main()) is False


def test_reach_settings_reach_hivemind() -> None:
    boot = f"/ip4/10.0.0.1/tcp/4000/p2p/{PEER}"
    assert Reach().p2p_kwargs([boot]) == {"use_relay": True, "use_auto_relay": False}
    reach = Reach(
        ("/ip4/203.0.113.7/tcp/31337", "/ip4/203.0.113.7/tcp/31337/p2p/" + PEER), True, True, "private"
    )
    assert reach.p2p_kwargs([boot]) == {
        "use_relay": True,
        "use_auto_relay": True,
        "announce_maddrs": list(reach.announce_maddrs),
        "force_reachability": "private",
        "trusted_relays": [boot],
    }
    assert reach.announced_ports() == (31337,)
    assert Reach(use_auto_relay=True, relays=(boot,)).p2p_kwargs([])["trusted_relays"] == [boot]
    assert peer_ids_of([boot, boot, "/ip4/10.0.0.1/tcp/1"]) == [PeerID.from_base58(PEER)]
    for bad in (
        {"announce_maddrs": ("/ip4/203.0.113.7/tcp/0",)},
        {"announce_maddrs": ("/ip4/203.0.113.7",)},
        {"announce_maddrs": ("nonsense",)},
        {"relays": (boot,)},
        {"use_auto_relay": True, "relays": ("/ip4/10.0.0.1/tcp/4000",)},
        {"use_relay": False, "use_auto_relay": True},
    ):
        with pytest.raises(ValueError):
            Reach(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("command", ["join", "bootstrap"])
def test_bad_reach_options_are_one_line_usage_errors(command: str) -> None:
    base = ["join", "--stage", "1", "--initial-peers", f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}"]
    args = base if command == "join" else ["bootstrap"]
    code, output = run(*args, "--announce-maddrs", "/ip4/203.0.113.7/tcp/0")
    one_line_usage_error(code, output, "explicit TCP port")
    code, output = run(*args, "--relay", f"/ip4/10.0.0.1/tcp/4000/p2p/{PEER}")
    one_line_usage_error(code, output, "use_auto_relay")
    code, output = run(*args, "--reachability", "sometimes")
    assert code == 2 and "--reachability" in output
