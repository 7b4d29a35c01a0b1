"""One compute thread per daemon, fed by a priority queue.

Torch work runs off the event loop, so RPC handlers keep answering while a stage computes. Tasks run one
at a time in priority order, FIFO within a priority: an optimizer step first (it is only ever queued when
nothing is held, and must run before newly arrived forward passes), then backward passes (they free
activations), then forward passes, and last the snapshots that state transfers are served from (a peer's
request never delays training).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class Priority(enum.IntEnum):
    STEP = 0
    BACKWARD = 1
    FORWARD = 2
    SERVE = 3


class ComputeQueue:
    """Serialises torch work onto one thread; `busy_seconds` feeds the throughput the node announces."""

    def __init__(self) -> None:
        self._queue: asyncio.PriorityQueue[tuple[int, int, Callable[[], Any], asyncio.Future[Any]]] = (
            asyncio.PriorityQueue()
        )
        self._order = itertools.count()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swarmnode-compute")
        self._worker: asyncio.Task[None] | None = None
        self.busy_seconds = 0.0

    def start(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._run(), name="compute-queue")

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    async def submit(self, priority: Priority, fn: Callable[[], T]) -> T:
        """Run `fn` on the compute thread after the queued tasks of higher or equal priority."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        await self._queue.put((int(priority), next(self._order), fn, future))
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            _, _, fn, future = await self._queue.get()
            if future.cancelled():
                continue
            started = loop.time()
            try:
                result = await loop.run_in_executor(self._executor, fn)
            except Exception as error:  # handed to the awaiting caller
                if not future.cancelled():
                    future.set_exception(error)
            else:
                if not future.cancelled():
                    future.set_result(result)
            finally:
                self.busy_seconds += loop.time() - started

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        self._executor.shutdown(wait=True, cancel_futures=True)
