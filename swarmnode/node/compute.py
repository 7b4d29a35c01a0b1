"""One compute thread per daemon, fed by a priority queue.

Torch work runs off the event loop, so RPC handlers keep answering while a stage computes. Tasks run one
at a time in priority order, FIFO within a priority: an optimizer step first (it is only ever queued when
nothing is held, and must run before newly arrived forward passes), then backward passes (they free
activations, and the previous hop waits for their gradient), then forward passes, then the weights' parts of
split backward passes (only this node's next update needs them: they fill the time the pipeline leaves
idle), and last the snapshots that state transfers are served from (a peer's request never delays training).

`busy_seconds` counts the compute thread's own time in the training jobs (`compute_clock`; validation passes
are left out), which the node announces as its throughput and the planners cost it by.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)


class Priority(enum.IntEnum):
    STEP = 0
    BACKWARD = 1
    FORWARD = 2
    WEIGHTS = 3
    SERVE = 4


def compute_clock(device_type: str, threads: int) -> Callable[[], float]:
    """The clock a compute thread times its jobs by: its own CPU time on a CPU computing in one thread, else
    wall time. A local swarm time-slices many nodes on a few cores; timed by the wall, equal replicas of a
    stage measured up to 1.5x apart as the scheduling fell, and the planners dealt them microbatches (and
    the model its data) by the timing. A GPU's work is not the thread's CPU time, nor is that of several
    torch threads."""
    return time.thread_time if device_type == "cpu" and threads == 1 else time.perf_counter


class ThroughputMeter:
    """Tokens per busy second over the microbatches after the first `skip`, told once `window` more are done
    (0 before). The first ones are slower (allocation, caches), and a few microbatches' time is as much the
    steps and copies that fell among them: counted from the start, equal replicas announced rates up to 1.5x
    apart for a dozen steps, and the planners dealt them microbatches by the timing. Over a window of 8
    after the first 8, equal replicas of two fresh local swarms sharing this 2-core machine (load 20) still
    announced first rates 1.46x and 1.61x apart; once 16 were measured, at most 1.33x."""

    def __init__(self, skip: int, window: int) -> None:
        if skip < 1 or window < 1:
            raise ValueError(f"skip and window must be at least 1, got {skip} and {window}")
        self.skip = skip
        self.window = window
        self._from: tuple[int, int, float] | None = None  # served, tokens, busy seconds when measuring began

    def rate(self, served: int, tokens: int, busy_seconds: float) -> float:
        """The rate, given the node's totals so far: microbatches served, tokens computed, busy seconds."""
        if self._from is None:
            if served >= self.skip:
                self._from = (served, tokens, busy_seconds)
            return 0.0
        tokens, busy = tokens - self._from[1], busy_seconds - self._from[2]
        return tokens / busy if served - self._from[0] >= self.window and tokens > 0 and busy > 0 else 0.0


class ComputeQueue:
    """Serialises torch work onto one thread; `busy_seconds` feeds the throughput the node announces."""

    def __init__(
        self, clock: Callable[[], float] = time.perf_counter, synchronize: Callable[[], None] = lambda: None
    ) -> None:
        self._queue: asyncio.PriorityQueue[tuple[int, int, Callable[[], Any], bool, asyncio.Future[Any]]] = (
            asyncio.PriorityQueue()
        )
        self._order = itertools.count()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swarmnode-compute")
        self._worker: asyncio.Task[None] | None = None
        self._clock = clock
        self._synchronize = synchronize  # waits for the device's queued work, so that a job's time is its own
        self.busy_seconds = 0.0  # written by the compute thread only

    def start(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._run(), name="compute-queue")

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    async def submit(self, priority: Priority, fn: Callable[[], T], measured: bool = True) -> T:
        """Run `fn` on the compute thread after the queued tasks of higher or equal priority; its time counts
        in `busy_seconds` if `measured` (a validation pass does not: which replica serves one is chance, and
        its time without tokens made that replica look slower)."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        await self._queue.put((int(priority), next(self._order), fn, measured, future))
        return await future

    def post(self, priority: Priority, fn: Callable[[], object]) -> None:
        """Queue `fn` as `submit` does, without waiting for it; an error it raises is logged."""
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_log_failure)
        self._queue.put_nowait((int(priority), next(self._order), fn, True, future))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            _, _, fn, measured, future = await self._queue.get()
            if future.cancelled():
                continue
            try:
                result = await loop.run_in_executor(self._executor, self._timed if measured else _untimed, fn)
            except Exception as error:  # handed to the awaiting caller
                if not future.cancelled():
                    future.set_exception(error)
            else:
                if not future.cancelled():
                    future.set_result(result)

    def _timed(self, fn: Callable[[], T]) -> T:
        """On the compute thread: `fn()`, its time added to `busy_seconds`."""
        started = self._clock()
        try:
            return fn()
        finally:
            self._synchronize()
            self.busy_seconds += self._clock() - started

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        self._executor.shutdown(wait=True, cancel_futures=True)


def _untimed(fn: Callable[[], T]) -> T:
    return fn()


def _log_failure(future: asyncio.Future[object]) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error("a compute job failed", exc_info=future.exception())
