"""`node.compute`: the compute thread's clock and the throughput a node announces."""

from __future__ import annotations

import asyncio
import time

import pytest

from swarmnode.node.compute import ComputeQueue, Priority, ThroughputMeter, compute_clock


def test_a_one_thread_cpu_node_times_its_jobs_by_its_own_cpu_time() -> None:
    assert compute_clock("cpu", 1) is time.thread_time
    assert compute_clock("cpu", 2) is time.perf_counter  # torch's other threads are not this one's time
    assert compute_clock("cuda", 1) is time.perf_counter  # nor is a GPU's work


def busy_after_a_wait(clock: object) -> float:
    """A job that waits 0.2 s without computing (as a thread does while the machine runs others)."""

    async def main() -> float:
        queue = ComputeQueue(clock)  # type: ignore[arg-type]
        queue.start()
        try:
            await queue.submit(Priority.FORWARD, lambda: time.sleep(0.2))
            return queue.busy_seconds
        finally:
            await queue.close()

    return asyncio.run(main())


def test_the_thread_clock_leaves_out_time_the_thread_did_not_compute() -> None:
    assert busy_after_a_wait(time.perf_counter) >= 0.2
    assert busy_after_a_wait(time.thread_time) < 0.05


def test_a_job_not_measured_leaves_busy_seconds_alone() -> None:
    async def main() -> tuple[float, float]:
        queue = ComputeQueue(time.perf_counter)
        queue.start()
        try:
            await queue.submit(Priority.FORWARD, lambda: time.sleep(0.1), measured=False)  # a validation pass
            before = queue.busy_seconds
            await queue.submit(Priority.FORWARD, lambda: time.sleep(0.1))
            return before, queue.busy_seconds
        finally:
            await queue.close()

    before, after = asyncio.run(main())
    assert before == 0.0 and after >= 0.1


def test_a_measured_job_waits_for_its_device_work_before_its_time_is_read() -> None:
    """A GPU runs a kernel after its call returns: the queue synchronises the device at the end of each
    measured job (work the job queued is its time, not the next job's), and not after a validation pass."""
    waited: list[float] = []

    async def main() -> float:
        queue = ComputeQueue(time.perf_counter, lambda: waited.append(time.sleep(0.1) or queue.busy_seconds))
        queue.start()
        try:
            await queue.submit(Priority.FORWARD, lambda: None, measured=False)
            await queue.submit(Priority.FORWARD, lambda: None)
            return queue.busy_seconds
        finally:
            await queue.close()

    busy = asyncio.run(main())
    assert waited == [0.0] and busy >= 0.1  # one wait, counted in the job's time


def test_throughput_is_measured_after_the_first_microbatches_and_over_a_window() -> None:
    meter = ThroughputMeter(skip=4, window=6)
    assert meter.rate(served=3, tokens=300, busy_seconds=9.0) == 0.0  # warming up
    assert meter.rate(served=4, tokens=400, busy_seconds=10.0) == 0.0  # measuring begins here
    assert meter.rate(served=9, tokens=900, busy_seconds=11.0) == 0.0  # five of six
    assert meter.rate(served=10, tokens=1000, busy_seconds=13.0) == 200.0  # 600 tokens in 3 s, not 1000 in 13
    assert meter.rate(served=12, tokens=1200, busy_seconds=13.0) == 800 / 3  # then over all since
    for skip, window in ((0, 4), (4, 0)):
        with pytest.raises(ValueError):
            ThroughputMeter(skip=skip, window=window)


def test_a_posted_job_runs_after_forward_passes_and_before_serving_and_its_error_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The weights' part of a split backward pass waits for the forward passes queued with it (they are
    on the pipeline's path), but not for a state snapshot; nobody awaits it, so a failure is logged."""
    ran: list[str] = []

    def fail() -> None:
        raise RuntimeError("no such group")

    async def main() -> None:
        queue = ComputeQueue(time.perf_counter)
        # queued before the worker starts, so the order is the queue's, not the arrival's
        served = asyncio.ensure_future(queue.submit(Priority.SERVE, lambda: ran.append("serve")))
        queue.post(Priority.WEIGHTS, lambda: ran.append("weights"))
        queue.post(Priority.WEIGHTS, fail)
        forward = asyncio.ensure_future(queue.submit(Priority.FORWARD, lambda: ran.append("forward")))
        await asyncio.sleep(0)  # both submissions are in the queue
        queue.start()
        try:
            await asyncio.gather(served, forward)
        finally:
            await queue.close()

    with caplog.at_level("ERROR", logger="swarmnode.node.compute"):
        asyncio.run(main())
    assert ran == ["forward", "weights", "serve"]
    assert "a compute job failed" in caplog.text and "no such group" in caplog.text
