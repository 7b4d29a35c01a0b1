"""HELLO: a flood of greetings costs at most two reads of the DHT, and a node greets the peers that route to
it."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from protocols.messages import Ack, NodeRecord, NodeState, Rpc, decode
from swarmnode.node.greetings import Greetings
from swarmnode.node.planning import SwarmRead
from swarmnode.records import PeerRecord


class FakeRouter:
    def __init__(self) -> None:
        self.called: list[tuple[str, str]] = []

    async def call(self, peer: str, method: str, meta: bytes, tensors: list[Any], timeout: float) -> None:
        self.called.append((peer, method))
        if peer == "dead":
            raise ConnectionError("unreachable")


def test_a_flood_of_greetings_reads_the_dht_twice_at_most() -> None:
    async def scenario() -> list[int]:
        reads, release, tasks = [0], asyncio.Event(), []

        async def refresh() -> None:
            reads[0] += 1
            await release.wait()

        def spawn(coro: Coroutine[Any, Any, None], name: str) -> None:
            tasks.append(asyncio.create_task(coro, name=name))

        greetings = Greetings(FakeRouter(), refresh, spawn)  # type: ignore[arg-type]
        for _ in range(10):
            meta, tensors = await greetings.on_hello("peer", None, [])
            assert isinstance(decode(meta), Ack) and tensors == []
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(*tasks)
        after_flood = reads[0]
        await greetings.on_hello("peer", None, [])  # the reads are over: a new greeting reads again
        await asyncio.gather(*tasks)
        return [len(tasks), after_flood, reads[0]]

    assert asyncio.run(scenario()) == [2, 2, 3]


def test_a_node_greets_the_peers_that_route_to_it() -> None:
    def online(stage: int, *names: str) -> list[PeerRecord]:
        return [PeerRecord(n, NodeRecord(NodeState.ONLINE, stage, 0, 0), 1e12) for n in names]

    read = SwarmRead({0: online(0, "d1", "dead"), 1: online(1, "me", "s1"), 2: online(2, "s2")})
    router = FakeRouter()

    async def refresh() -> None:
        pass

    greetings = Greetings(router, refresh, lambda coro, name: None)  # type: ignore[arg-type]
    asyncio.run(greetings.greet(read, "me", 1, 2))
    assert sorted(router.called) == [("d1", Rpc.HELLO), ("dead", Rpc.HELLO)]
    router.called.clear()
    asyncio.run(greetings.greet(read, "d1", 0, 2))
    assert sorted(router.called) == [("me", Rpc.HELLO), ("s1", Rpc.HELLO), ("s2", Rpc.HELLO)]


def test_news_wakes_a_waiter_once_a_greeting_read_the_dht() -> None:
    async def scenario() -> list[object]:
        tasks: list[asyncio.Task[None]] = []
        reads: list[float] = []

        async def refresh() -> None:
            reads.append(asyncio.get_running_loop().time())

        def spawn(coro: Coroutine[Any, Any, None], name: str) -> None:
            tasks.append(asyncio.create_task(coro, name=name))

        greetings = Greetings(FakeRouter(), refresh, spawn)  # type: ignore[arg-type]
        quiet = await greetings.news(0.05)  # nobody greeted: the wait runs out
        waiter = asyncio.create_task(greetings.news(30.0))
        await asyncio.sleep(0)
        started = asyncio.get_running_loop().time()
        await greetings.on_hello("peer", None, [])
        woke = await waiter
        waited = asyncio.get_running_loop().time() - started
        again = await greetings.news(0.05)  # that news was taken: the next wait runs out again
        await asyncio.gather(*tasks)
        return [quiet, woke, waited < 5.0, len(reads), again]

    assert asyncio.run(scenario()) == [False, True, True, 1, False]
