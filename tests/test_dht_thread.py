"""The DHT served from a thread of the daemon's process (`swarmnode/dht_thread.py`), with real p2pds on
loopback: calls from any thread and any event loop, no process of its own, a p2pd that dies, a clean end."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils import get_dht_time

from swarmnode.dht_thread import THREAD_NAME, DHTThread
from swarmnode.procstat import proc_stat, processes

LOOPBACK = {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"]}


def _children() -> list[int]:
    return [proc.pid for proc in processes() if proc.ppid == os.getpid() and not proc.zombie]


def _wait(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_two_nodes_store_and_read_from_any_loop_and_end_cleanly() -> None:
    before = set(_children())
    threads_before = [t.name for t in threading.enumerate()].count(THREAD_NAME)
    first = DHTThread([], p2p_kwargs=LOOPBACK)
    maddrs = [str(addr) for addr in first.call_blocking(lambda node: node.get_visible_maddrs(), 10)]
    second = DHTThread([], maddrs, p2p_kwargs=LOOPBACK)
    try:
        # the daemon's process gains p2pds only: each node runs in a thread here, not a process of its own
        started = set(_children()) - before
        assert sorted(proc_stat(pid).comm for pid in started) == ["p2pd", "p2pd"]  # type: ignore[union-attr]
        assert {first.p2pd_pid, second.p2pd_pid} == started
        assert [t.name for t in threading.enumerate()].count(THREAD_NAME) == threads_before + 2
        assert first.is_alive() and second.is_alive() and first.p2pd_exit_code is None

        expiry = get_dht_time() + 60

        async def store_and_read() -> object:
            assert await first.call(lambda node: node.store("key", b"value", expiry))
            found = await second.call(lambda node: node.get("key", latest=True))
            return found.value if found is not None else None

        # each asyncio.run is a new event loop, as `swarmnode status --watch` reads anew each time
        assert asyncio.run(store_and_read()) == b"value"
        assert asyncio.run(second.call(lambda node: node.get("key", latest=True))).value == b"value"
        assert first.call_blocking(lambda node: node.get("key", latest=True), 10).value == b"value"
        assert str(first.peer_id) == str(first.call_blocking(_peer_id, 10))
    finally:
        second.shutdown(2.0)
        first.shutdown(2.0)
    assert not first.is_alive() and not second.is_alive()
    assert set(_children()) <= before, "a p2pd outlived its DHT"
    assert [t.name for t in threading.enumerate()].count(THREAD_NAME) == threads_before
    assert first.native_id is None
    with pytest.raises(RuntimeError, match="stopped"):
        first.submit(_peer_id)
    first.shutdown(2.0)  # a second shutdown does nothing


async def _peer_id(node: DHTNode) -> object:
    return node.peer_id


def test_a_p2pd_that_dies_leaves_the_dht_not_alive() -> None:
    dht = DHTThread([], p2p_kwargs=LOOPBACK)
    try:
        os.kill(dht.p2pd_pid, signal.SIGKILL)
        _wait(lambda: not dht.is_alive(), 10, "the DHT to notice its p2pd's end")
        assert dht.p2pd_exit_code == -signal.SIGKILL
    finally:
        dht.shutdown(2.0)
    assert dht.native_id is None


def test_a_blocking_call_from_the_dht_thread_is_refused() -> None:
    dht = DHTThread([], p2p_kwargs=LOOPBACK)
    try:

        async def call_myself(node: DHTNode) -> str:
            try:
                dht.call_blocking(_peer_id, 1)
            except RuntimeError as error:
                return str(error)
            return "no error"

        assert "never return" in dht.call_blocking(call_myself, 10)
    finally:
        dht.shutdown(2.0)


def test_a_start_that_fails_raises_here_and_leaves_nothing() -> None:
    before = set(_children())
    threads_before = [t.name for t in threading.enumerate()].count(THREAD_NAME)
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWLB7GnWgJsFc3uksAJCBTJxDhqtsokMd6zCUZ4NFCHqE2"
    with pytest.raises(P2PDaemonError, match="bootstrap peers"):
        DHTThread([], [nobody], p2p_kwargs=LOOPBACK)
    _wait(lambda: set(_children()) <= before, 10, "the failed p2pd to end")
    assert [t.name for t in threading.enumerate()].count(THREAD_NAME) == threads_before


def test_a_node_that_no_initial_peer_answers_ends_its_p2pd() -> None:
    """Its initial peer is a bare libp2p peer: p2pd connects, but no DHT answers there."""

    async def scenario() -> None:
        bare = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            before = set(_children())
            maddrs = [str(addr) for addr in await bare.get_visible_maddrs()]
            with pytest.raises(RuntimeError, match="bootstrap failed"):
                await asyncio.to_thread(DHTThread, [], maddrs, p2p_kwargs=LOOPBACK)
            assert set(_children()) <= before, "the failed node's p2pd lives on"
        finally:
            await bare.shutdown()

    asyncio.run(scenario())


def test_a_process_that_exits_without_shutting_its_dht_down_leaves_no_p2pd() -> None:
    script = (
        "from swarmnode.dht_thread import DHTThread\n"
        "dht = DHTThread([], p2p_kwargs={'host_maddrs': ['/ip4/127.0.0.1/tcp/0']})\n"
        "print(dht.p2pd_pid, flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])

    def ended() -> bool:
        proc = proc_stat(pid)
        return proc is None or proc.zombie or proc.comm != "p2pd"

    try:
        _wait(ended, 10, "the p2pd of a process that exited to end")
    finally:
        if not ended():
            os.kill(pid, signal.SIGKILL)


def test_a_lost_connection_left_in_a_task_is_no_error_and_a_real_one_still_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dht = DHTThread([], p2p_kwargs=LOOPBACK)

    async def leave_failed_tasks(node: DHTNode) -> None:
        """Tasks that fail with nobody to retrieve their errors, as hivemind's p2pd client leaves one."""

        async def fail(error: Exception) -> None:
            raise error

        tasks = [asyncio.ensure_future(fail(e)) for e in (ConnectionResetError("lost"), ValueError("a bug"))]
        await asyncio.wait(tasks)
        tasks.clear()

    try:
        with caplog.at_level(logging.DEBUG):
            dht.call_blocking(leave_failed_tasks, 10)
            gc.collect()  # asyncio reports a failed task's unretrieved error when the task is collected
    finally:
        dht.shutdown(2.0)
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert [type(record.exc_info[1]) for record in errors if record.exc_info] == [ValueError]
    assert any("lost" in record.getMessage() for record in caplog.records if record.levelno == logging.DEBUG)
