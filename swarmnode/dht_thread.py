"""hivemind's DHT node served from a thread of this process, not from a forked process of its own.

`hivemind.DHT` forks a process that runs a `DHTNode` (and starts p2pd) and answers calls over a pipe, each a
pickled message and an `MPFuture`. Here the same `DHTNode` runs on an event loop of its own in a thread of the
daemon: calls are coroutines handed to that loop, the DHT's work (serving peers' lookups, checking records)
stays off the loop of the node's transport and router, and a daemon is two processes (itself and p2pd), not
three. `docs/scaling.md` has the measured difference.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator, RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

T = TypeVar("T")

logger = logging.getLogger(__name__)

THREAD_NAME = "swarmnode-dht"


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; this only guards unusual platforms
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _quiet_lost_connections(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The DHT loop's exception handler. hivemind's p2pd client leaves a task failed with a lost connection
    when p2pd ends (at every shutdown), which asyncio reports, whenever the task is collected, as an error
    never retrieved: logged at debug level here. Anything else is reported as asyncio does."""
    if isinstance(context.get("exception"), ConnectionError):
        logger.debug("%s: %r", context.get("message"), context.get("exception"))
        return
    loop.default_exception_handler(context)


class DHTThread:
    """One `DHTNode` and the p2pd it runs over, served by an event loop in a thread of this process.

    Blocks until the node has joined the DHT through `initial_peers`; the error raised on the way (a p2pd
    that did not start, no initial peer answering) is raised here, after the p2pd (if it started) has
    been ended. `p2p_kwargs` go to `hivemind.P2P.create`, `node_kwargs` to `DHTNode.create`.
    """

    def __init__(
        self,
        record_validators: list[RecordValidatorBase],
        initial_peers: Sequence[str] = (),
        client_mode: bool = False,
        p2p_kwargs: Mapping[str, Any] | None = None,
        **node_kwargs: Any,
    ) -> None:
        self._loop = _new_loop()
        self._loop.set_exception_handler(_quiet_lost_connections)
        start = self._start(
            record_validators, list(initial_peers), client_mode, dict(p2p_kwargs or {}), node_kwargs
        )
        self._started: concurrent.futures.Future[tuple[P2P, DHTNode]] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._serve, args=(start,), name=THREAD_NAME, daemon=True)
        self._thread.start()
        self._p2p, self._node = self._started.result()
        self.peer_id: PeerID = self._node.peer_id

    @staticmethod
    async def _start(
        record_validators: list[RecordValidatorBase],
        initial_peers: list[str],
        client_mode: bool,
        p2p_kwargs: dict[str, Any],
        node_kwargs: dict[str, Any],
    ) -> tuple[P2P, DHTNode]:
        """Start p2pd, then the DHT node over it (as `DHTNode.create` would start both, but here a node
        that fails to join ends the p2pd it started)."""
        if client_mode:
            p2p_kwargs.setdefault("dht_mode", "client")
        p2p = await P2P.create(initial_peers=initial_peers, **p2p_kwargs)
        try:
            node = await DHTNode.create(
                p2p=p2p,
                initial_peers=initial_peers,
                client_mode=client_mode,
                record_validator=CompositeValidator(record_validators),
                **node_kwargs,
            )
        except BaseException:
            await p2p.shutdown()
            raise
        return p2p, node

    def _serve(self, start: Coroutine[Any, Any, tuple[P2P, DHTNode]]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            try:
                started = self._loop.run_until_complete(start)
            except BaseException as error:  # handed to the starting thread, which raises it
                self._started.set_exception(error)
                return
            self._started.set_result(started)
            self._loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    def submit(self, call: Callable[[DHTNode], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        """Run `call(node)` on the DHT's loop; its future, to wait on from any thread."""
        if not self._thread.is_alive():
            raise RuntimeError("the DHT thread has stopped")
        return asyncio.run_coroutine_threadsafe(call(self._node), self._loop)

    async def call(self, call: Callable[[DHTNode], Coroutine[Any, Any, T]]) -> T:
        """`submit`, awaited on the caller's event loop (cancelling the wait cancels the call)."""
        return await asyncio.wrap_future(self.submit(call))

    def call_blocking(self, call: Callable[[DHTNode], Coroutine[Any, Any, T]], timeout: float) -> T:
        """`submit`, waited for here; not from the DHT's own thread (it would wait for itself)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("a blocking DHT call from the DHT's own thread would never return")
        return self.submit(call).result(timeout)

    @property
    def native_id(self) -> int | None:
        """The thread's id as the kernel knows it (`/proc/self/task/ID`), None once it has ended."""
        return self._thread.native_id if self._thread.is_alive() else None

    @property
    def daemon_listen_maddr(self) -> Multiaddr:
        """Where this node's p2pd takes clients (`hivemind.P2P.replicate` connects there)."""
        return self._p2p.daemon_listen_maddr

    @property
    def p2pd_pid(self) -> int:
        """The pid of the p2pd this node started."""
        return int(self._p2pd().pid)

    @property
    def p2pd_exit_code(self) -> int | None:
        """p2pd's exit code once it has ended (negative: the signal that ended it); None while it runs."""
        return self._p2pd().returncode

    def is_alive(self) -> bool:
        """The thread serves and its p2pd runs (a p2pd that exited or was killed leaves the node deaf)."""
        return self._thread.is_alive() and self._p2pd().returncode is None

    def _p2pd(self) -> asyncio.subprocess.Process:
        """hivemind keeps its handle on p2pd private; `P2P.create` always starts one here."""
        return self._p2p._child

    def shutdown(self, timeout: float) -> None:
        """Shut the node down (its p2pd with it) and stop the thread, waiting up to about `timeout` s."""
        if not self._thread.is_alive():
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError("the DHT thread cannot shut itself down")

        async def close(node: DHTNode) -> None:
            try:
                await asyncio.wait_for(node.shutdown(), timeout)
                await asyncio.wait_for(self._p2p.shutdown(), timeout)
            finally:
                if self._p2pd().returncode is None:  # a p2pd that did not end in time
                    with contextlib.suppress(ProcessLookupError):
                        self._p2pd().kill()
                self._loop.stop()

        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            self.submit(close).result(timeout + 1.0)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the DHT thread did not stop within %.1f s", timeout)
