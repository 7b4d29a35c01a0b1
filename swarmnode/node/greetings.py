"""The HELLO rpc: a node that comes online greets the peers that route to it, and a greeted node reads the
DHT at once rather than at its next refresh (and a data node waiting for the swarm goes on at once)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from torch import Tensor

from protocols.messages import Ack, Rpc, encode
from swarmnode.node.planning import SwarmRead
from swarmnode.node.router import Router

GREETING_TIMEOUT_S = 1.0


class Greetings:
    """One node's side of HELLO: `greet` the peers once it serves, `on_hello` (the handler) when greeted.

    However many greetings arrive, one read of the DHT runs at a time and at most one more follows it, so a
    flood costs no more than two reads. `news` waits for such a read to finish."""

    def __init__(
        self,
        router: Router,
        refresh: Callable[[], Awaitable[None]],
        spawn: Callable[[Coroutine[Any, Any, None], str], None],
    ) -> None:
        self._router = router
        self._refresh = refresh
        self._spawn = spawn
        self._greeted: bool | None = None  # None: no read running; True: another one asked for
        self._read = asyncio.Event()  # set when a read for greetings finished; cleared by `news`

    async def on_hello(self, peer: str, _: None, tensors: list[Tensor]) -> tuple[bytes, list[Tensor]]:
        """A node just came online: read the DHT now (or once more after the read now running)."""
        if self._greeted is None:
            self._greeted = False
            self._spawn(self._refresh_for_greetings(), "hello-refresh")
        else:
            self._greeted = True
        return encode(Ack()), []

    async def _refresh_for_greetings(self) -> None:
        try:
            await self._refresh()
            self._read.set()
            while self._greeted:  # greeted again while reading: read once more, for them all
                self._greeted = False
                await self._refresh()
                self._read.set()
        finally:
            self._greeted = None

    async def news(self, timeout: float) -> bool:
        """Wait until a read of the DHT for greetings has finished since the last call (True: the swarm read
        is fresh), or `timeout` seconds (False)."""
        try:
            await asyncio.wait_for(self._read.wait(), timeout)
        except TimeoutError:
            return False
        self._read.clear()
        return True

    async def greet(self, read: SwarmRead, me: str, stage: int, stages: int) -> None:
        """Tell the peers that route to `me`, serving `stage` of `stages`, that it serves now, so that they
        read the DHT at once: a stage node greets the data nodes (their next plan can use it), a data node
        the stage nodes (they take forwards only from data nodes they know). Unanswered greetings are
        dropped."""
        greeted = range(1, stages + 1) if stage == 0 else (0,)
        peers = [p for k in greeted for p in read.online(k) if p != me]
        await asyncio.gather(
            *(self._router.call(p, Rpc.HELLO, b"", [], timeout=GREETING_TIMEOUT_S) for p in peers),
            return_exceptions=True,
        )
