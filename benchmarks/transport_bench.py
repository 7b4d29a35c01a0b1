"""Side-by-side cost of pushing one fp32 activation to another process and getting a small ack back.

Candidates, all between two OS processes on loopback (each with its own p2pd where libp2p is involved):

- hivemind unary:   `call_protobuf_handler` with an `ExpertRequest` (hivemind.compression); capped at 4 MiB.
- hivemind stream:  `iterate_protobuf_handler`, the tensor split by `split_for_streaming` (64 KiB parts).
- libp2p per call:  swarmnode framing on a fresh raw libp2p stream per call (`call_binary_stream_handler`).
- swarmnode libp2p: `swarmnode.transport.Transport` (default): persistent, pooled libp2p streams.
- swarmnode direct: `Transport` with `direct_host`: a direct TCP stream granted over libp2p, pooled;
                    plaintext, which a daemon offers only on loopback.
- swarmnode encrypted: the same direct stream, encrypted and bound to both libp2p identities: the path two
                    daemons on different hosts use by default (`remote_default` in the JSON).
- plain TCP, in place: the same, read as the direct path reads (`_channel.Channel`, plaintext, no handshake):
                    a tensor's bytes received straight into its memory instead of through a StreamReader.
- plain TCP:        swarmnode framing on one persistent asyncio TCP connection (a StreamReader: three copies
                    on the way into a tensor): the baseline every ratio is taken against (`ratio_vs_tcp`).

Each runs with the tensor as float32 and as float16 on the wire (hivemind's FLOAT16); MiB/s counts the fp32
size; CPU is that of both processes and both p2pd together. Since the direct path reads in place, it can be
faster than "plain TCP"; "plain TCP, in place" is its ceiling (`ratio_vs_in_place` in the JSON). Run
`python benchmarks/transport_bench.py` (about a minute; `--quick`: a few seconds; `--json FILE`: also write
every cell as a row, with the machine's load; `--options "swarmnode encrypted"`: that option and plain TCP
only).

`--netns` (root, `ip netns`): the two processes on two hosts instead, network namespaces on one switched
segment (`tests/netns.py`), each with its own address, so that every option crosses veths and a bridge as
between machines. There "swarmnode direct" is left out (plaintext never leaves loopback), and "swarmnode
encrypted" is exactly what two daemons on different hosts use.

Each cell's pushes are taken in ten short blocks, in turn with the other options of its column, so that the
ratios against plain TCP compare like with like; the machine is noisy all the same: expect 30% differences
between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import uvloop
from hivemind.compression import deserialize_tensor_stream, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto.runtime_pb2 import CompressionType, ExpertRequest, ExpertResponse
from hivemind.utils.asyncio import as_aiter
from hivemind.utils.streaming import split_for_streaming

from swarmnode.identity import Identity
from swarmnode.transport import Compression, Limits, Transport, TransportConfig
from swarmnode.transport._channel import Channel
from swarmnode.transport._framing import encode_request, encode_response, read_frame, write_frame

SIZES = (16, 64 << 10, 1 << 20, 8 << 20, 32 << 20)
UNARY_CAP = 4 << 20
ROUNDS = 10  # blocks per option and cell, taken in turn with the other options'
LOOPBACK = "127.0.0.1"
CLONE_NEWNET = 0x40000000
OPTIONS = (
    "hivemind unary",
    "hivemind stream",
    "libp2p per call",
    "swarmnode libp2p",
    "swarmnode direct",
    "swarmnode encrypted",
    "plain TCP, in place",
    "plain TCP",
)
LOOPBACK_ONLY = ("swarmnode direct",)
REMOTE_DEFAULT = "swarmnode encrypted"
CONFIG = TransportConfig(limits=Limits(max_message_bytes=1 << 30))
_cpu_root = os.getpid()  # whose process tree `_tree_cpu_seconds` counts: both sides and their p2pds


@dataclass(frozen=True)
class Place:
    """Where one side runs: its address, and the network namespace it enters first (None: this one)."""

    address: str = LOOPBACK
    namespace: str | None = None

    def enter(self) -> None:
        """Enter the namespace before opening a socket or starting a p2pd (they inherit it)."""
        if self.namespace is None:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        with open(f"/var/run/netns/{self.namespace}") as handle:
            if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"cannot enter network namespace {self.namespace}")

    @property
    def maddrs(self) -> list[str]:
        return [f"/ip4/{self.address}/tcp/0"]

    @property
    def direct(self) -> TransportConfig:
        """The direct path from here: plaintext accepted on loopback only."""
        return dataclasses.replace(CONFIG, direct_host=self.address)

    @property
    def encrypted(self) -> TransportConfig:
        """The direct path, sealed even on loopback, as between hosts."""
        return dataclasses.replace(self.direct, plaintext_loopback=False)


Push = Callable[[torch.Tensor, Compression], Awaitable[None]]


@dataclass
class Cell:
    seconds: float  # median wall seconds per push
    cpu_seconds: float  # mean CPU seconds per push, both processes and both p2pd together


Results = dict[tuple[str, Compression, int], Cell | None]  # None: over the unary cap


# ---- the server process ---------------------------------------------------------------------------------


async def _unary(request: ExpertRequest, context: P2PContext) -> ExpertResponse:
    for tensor in request.tensors:
        deserialize_torch_tensor(tensor)
    return ExpertResponse(metadata=b"ok")


async def _streaming(
    requests: AsyncIterator[ExpertRequest], context: P2PContext
) -> AsyncIterator[ExpertResponse]:
    await deserialize_tensor_stream(request.tensors async for request in requests)
    yield ExpertResponse(metadata=b"ok")


async def _ack(peer_id: PeerID, meta: bytes, tensors: list[torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
    return b"ok", []


async def _tcp_session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.transport.set_write_buffer_limits(high=0)
    try:
        while True:
            await read_frame(reader, CONFIG.limits)
            await write_frame(writer, encode_response(b"ok", [], Compression.NONE))
    except asyncio.IncompleteReadError:
        writer.close()


async def _p2p(identity: Identity, place: Place, initial_peers: list[str] | None = None) -> P2P:
    """A P2P whose p2pd runs with `identity` (as a daemon's does), so that the encrypted path can prove it."""
    with tempfile.TemporaryDirectory() as folder:
        key_file = Path(folder) / "identity.key"
        identity.save(key_file)
        return await P2P.create(
            initial_peers=initial_peers or [],
            host_maddrs=place.maddrs,
            nat_port_map=False,
            identity_path=str(key_file),
            check_if_identity_free=False,
        )


async def _serve(conn: Connection, place: Place) -> None:
    identity = Identity.generate()
    p2p = await _p2p(identity, place)
    await p2p.add_protobuf_handler("bench.unary", _unary, ExpertRequest)
    await p2p.add_protobuf_handler(
        "bench.stream", _streaming, ExpertRequest, stream_input=True, stream_output=True
    )
    transport = Transport(p2p, place.direct, identity=identity)  # plaintext (loopback) and encrypted calls
    transport.register("ack", _ack)
    await transport.start()
    tcp = await asyncio.start_server(_tcp_session, place.address, 0)
    sessions: set[asyncio.Task[None]] = set()

    def in_place_session(channel: Channel) -> None:
        session = asyncio.ensure_future(_tcp_session(*channel.open_streams(None, None)))
        sessions.add(session)
        session.add_done_callback(sessions.discard)

    loop = asyncio.get_running_loop()
    in_place = await loop.create_server(lambda: Channel(in_place_session), place.address, 0)
    ports = tuple(server.sockets[0].getsockname()[1] for server in (tcp, in_place))
    conn.send(([str(maddr) for maddr in await p2p.get_visible_maddrs()], ports))
    await loop.run_in_executor(None, conn.recv)  # until the client says stop
    tcp.close()
    in_place.close()
    await transport.close()
    await p2p.shutdown()


def _server_main(conn: Connection, place: Place) -> None:
    place.enter()
    torch.set_num_threads(1)
    uvloop.run(_serve(conn, place))


# ---- the client -----------------------------------------------------------------------------------------


def _hivemind_compression(compression: Compression) -> int:
    return CompressionType.FLOAT16 if compression is Compression.FLOAT16 else CompressionType.NONE


def _tree_cpu_seconds() -> float:
    """User + system CPU time of the benchmark's first process and all its live descendants (from /proc)."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with suppress(OSError), open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
                stats[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, utime + stime
    tree, frontier = {_cpu_root}, [_cpu_root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _) in stats.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(stats[pid][1] for pid in tree if pid in stats) / os.sysconf("SC_CLK_TCK")


@dataclass
class _Samples:
    times: list[float] = dataclasses.field(default_factory=list)  # wall seconds of each push
    cpu_seconds: float = 0.0  # CPU of the blocks those pushes ran in, both processes and both p2pd


async def _measure(
    push: Push, tensor: torch.Tensor, compression: Compression, budget: float, samples: _Samples
) -> None:
    """Push for `budget` seconds (at least once) into `samples`."""
    cpu_start, deadline, count = _tree_cpu_seconds(), time.perf_counter() + budget, 0
    while count < 1 or time.perf_counter() < deadline:
        start = time.perf_counter()
        await push(tensor, compression)
        samples.times.append(time.perf_counter() - start)
        count += 1
    samples.cpu_seconds += _tree_cpu_seconds() - cpu_start


async def _measure_side_by_side(
    pushes: dict[str, Push], tensor: torch.Tensor, compression: Compression, budget: float
) -> dict[str, Cell]:
    """Each option's cell, measured in ROUNDS short blocks taken in turn (the order rotating each round), so
    that a change in the machine's load reaches every option alike."""
    for push in pushes.values():
        await push(tensor, compression)  # warm up: open streams, fault in buffers
    samples = {option: _Samples() for option in pushes}
    options = list(pushes)
    for turn in range(ROUNDS):
        for option in options[turn % len(options) :] + options[: turn % len(options)]:
            await _measure(pushes[option], tensor, compression, budget / ROUNDS, samples[option])
    return {
        option: Cell(statistics.median(s.times), s.cpu_seconds / len(s.times))
        for option, s in samples.items()
    }


async def _client(
    place: Place,
    server_place: Place,
    maddrs: list[str],
    ports: tuple[int, int],
    sizes: tuple[int, ...],
    budget: float,
    options: tuple[str, ...],
) -> Results:
    identity = Identity.generate()
    p2p = await _p2p(identity, place, maddrs)
    server = PeerID.from_base58(maddrs[0].rsplit("/p2p/", 1)[1])
    persistent = Transport(p2p, CONFIG)
    per_call = Transport(p2p, dataclasses.replace(CONFIG, max_idle_streams=0))
    encrypted = Transport(p2p, place.encrypted, identity=identity)
    direct = Transport(p2p, place.direct) if place.address == LOOPBACK else encrypted  # (left out below)
    reader, writer = await asyncio.open_connection(server_place.address, ports[0])
    writer.transport.set_write_buffer_limits(high=0)
    _, channel = await asyncio.get_running_loop().create_connection(Channel, server_place.address, ports[1])
    in_place_reader, in_place_writer = channel.open_streams(None, None)
    in_place_writer.transport.set_write_buffer_limits(high=0)

    async def unary(tensor: torch.Tensor, compression: Compression) -> None:
        request = ExpertRequest(tensors=[serialize_torch_tensor(tensor, _hivemind_compression(compression))])
        await p2p.call_protobuf_handler(server, "bench.unary", request, ExpertResponse)

    async def stream(tensor: torch.Tensor, compression: Compression) -> None:
        serialized = serialize_torch_tensor(tensor, _hivemind_compression(compression))
        parts = [ExpertRequest(tensors=[part]) for part in split_for_streaming(serialized)]
        async for _ in await p2p.iterate_protobuf_handler(
            server, "bench.stream", as_aiter(*parts), ExpertResponse
        ):
            pass

    def via(transport: Transport) -> Push:
        async def push(tensor: torch.Tensor, compression: Compression) -> None:
            await transport.call(server, "ack", b"", [tensor], 60.0, compression=compression)

        return push

    def tcp_through(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Push:
        async def push(tensor: torch.Tensor, compression: Compression) -> None:
            await write_frame(writer, encode_request("ack", 60.0, compression, b"", [tensor], compression))
            await read_frame(reader, CONFIG.limits)

        return push

    pushes = dict(
        zip(
            OPTIONS,
            (
                unary,
                stream,
                via(per_call),
                via(persistent),
                via(direct),
                via(encrypted),
                tcp_through(in_place_reader, in_place_writer),
                tcp_through(reader, writer),
            ),
            strict=True,
        )
    )
    left_out = LOOPBACK_ONLY if place.address != LOOPBACK else ()
    pushes = {option: push for option, push in pushes.items() if option in options and option not in left_out}
    results: Results = {}
    try:
        for size in sizes:
            tensor = torch.randn(size // 4)
            for compression in Compression:
                wire_bytes = size // 2 if compression is Compression.FLOAT16 else size
                measured = {
                    option: push
                    for option, push in pushes.items()
                    if not (option == "hivemind unary" and wire_bytes >= UNARY_CAP)
                }
                cells = await _measure_side_by_side(measured, tensor, compression, budget)
                for option in pushes:
                    results[option, compression, size] = cells.get(option)  # None: over the cap
    finally:
        writer.close()
        in_place_writer.close()
        for transport in {persistent, per_call, direct, encrypted}:
            await transport.close()
        if REMOTE_DEFAULT in pushes and encrypted.stats.streams_opened["encrypted"] == 0:
            raise RuntimeError("the encrypted option never used the encrypted path")
        await p2p.shutdown()
    return results


# ---- report ---------------------------------------------------------------------------------------------


def _size_name(size: int) -> str:
    if size >= 1 << 20:
        return f"{size >> 20} MiB"
    return f"{size >> 10} KiB" if size >= 1 << 10 else f"{size} B"


def _table(results: Results, show: Callable[[Cell, Cell, int], str]) -> str:
    sizes = sorted({size for _, _, size in results})
    lines = [
        "| option | wire | " + " | ".join(_size_name(size) for size in sizes) + " |",
        "|---|---|" + "---|" * len(sizes),
    ]
    measured = {option for option, _, _ in results}
    for compression in Compression:
        for option in (option for option in OPTIONS if option in measured):
            cells = []
            for size in sizes:
                cell, ceiling = results[option, compression, size], results["plain TCP", compression, size]
                cells.append("over the cap" if cell is None or ceiling is None else show(cell, ceiling, size))
            wire = "fp16" if compression is Compression.FLOAT16 else "fp32"
            lines.append(f"| {option} | {wire} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _speed(cell: Cell, ceiling: Cell, size: int) -> str:
    rate = f"{size / 2**20 / cell.seconds:.0f} MiB/s, " if size >= 1 << 10 else ""
    return f"{cell.seconds * 1e3:.2f} ms, {rate}{ceiling.seconds / cell.seconds:.2f}x"


def _cpu(cell: Cell, ceiling: Cell, size: int) -> str:
    return f"{cell.cpu_seconds * 1e3:.2f} ms, {cell.cpu_seconds / max(ceiling.cpu_seconds, 1e-6):.1f}x"


def _rows(results: Results) -> list[dict[str, object]]:
    """One row per measured cell: its option, wire dtype and size, and its ratios against plain TCP."""
    rows: list[dict[str, object]] = []
    for (option, compression, size), cell in results.items():
        ceiling = results["plain TCP", compression, size]
        in_place = results.get(("plain TCP, in place", compression, size))
        if cell is None or ceiling is None:
            continue
        rows.append(
            {
                "option": option,
                "wire": "fp16" if compression is Compression.FLOAT16 else "fp32",
                "size_bytes": size,
                "seconds": cell.seconds,
                "mib_per_s": size / 2**20 / cell.seconds,
                "cpu_seconds": cell.cpu_seconds,
                "ratio_vs_tcp": ceiling.seconds / cell.seconds,
                "ratio_vs_in_place": None if in_place is None else in_place.seconds / cell.seconds,
                "cpu_vs_tcp": cell.cpu_seconds / max(ceiling.cpu_seconds, 1e-6),
                "remote_default": option == REMOTE_DEFAULT,
            }
        )
    return rows


async def _swarmnode_codec(tensor: torch.Tensor, compression: Compression) -> float:
    """Encode, then decode from an in-memory stream (the same copies as from a socket); return seconds."""
    reader = asyncio.StreamReader()
    start = time.perf_counter()
    frame = encode_request("x", 1.0, compression, b"", [tensor], compression)
    elapsed = time.perf_counter() - start
    reader.feed_data(b"".join(frame))
    reader.feed_eof()
    start = time.perf_counter()
    await read_frame(reader, CONFIG.limits)
    return elapsed + time.perf_counter() - start


def _codec_table() -> str:
    tensor = torch.randn(8 << 20)
    lines = ["| wire | hivemind.compression | swarmnode framing |", "|---|---|---|"]
    for compression in Compression:
        hivemind, swarmnode = [], []
        for _ in range(3):
            start = time.perf_counter()
            deserialize_torch_tensor(serialize_torch_tensor(tensor, _hivemind_compression(compression)))
            hivemind.append(time.perf_counter() - start)
            swarmnode.append(asyncio.run(_swarmnode_codec(tensor, compression)))
        wire = "fp16" if compression is Compression.FLOAT16 else "fp32"
        lines.append(f"| {wire} | {min(hivemind) * 1e3:.1f} ms | {min(swarmnode) * 1e3:.1f} ms |")
    return "\n".join(lines)


@contextmanager
def _places(parser: argparse.ArgumentParser, netns: bool) -> Iterator[tuple[Place, Place]]:
    """Where the server and the client run: both on loopback, or each in a namespace of its own."""
    if not netns:
        yield Place(), Place()
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from netns import Network, unavailable_reason  # tests/netns.py

    reason = unavailable_reason()
    if reason is not None:
        parser.error(f"--netns: {reason}")
    with Network() as network:
        server, client = network.host("srv"), network.host("cli")
        yield Place(server.address, server.namespace), Place(client.address, client.namespace)


def _client_main(conn: Connection, *work: Any) -> None:
    work[0].enter()
    try:
        conn.send(("results", uvloop.run(_client(*work))))
    except BaseException as error:  # the parent waits on this pipe: tell it, whatever happened
        conn.send(("error", repr(error)))
        raise


def _client_elsewhere(ctx: Any, *work: Any) -> Results:
    """`_client(*work)` in a child process, which enters the client's namespace first."""
    ours, theirs = ctx.Pipe()
    client = ctx.Process(target=_client_main, args=(theirs, *work), daemon=True)
    client.start()
    theirs.close()
    try:
        kind, value = ours.recv()
    finally:
        _stop(client)
    if kind != "results":
        raise RuntimeError(f"the client failed: {value}")
    return value


def _stop(process: Any) -> None:
    process.join(timeout=15)
    if process.is_alive():
        process.kill()  # by pid
        process.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three sizes, briefly (a smoke run)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows and the load here")
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=None, help="fp32 bytes per push (default: all)"
    )
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds per cell (default 0.6, quick 0.1)"
    )
    parser.add_argument(
        "--netns", action="store_true", help="the two sides in two network namespaces (root, `ip netns`)"
    )
    parser.add_argument(
        "--options",
        nargs="+",
        choices=OPTIONS,
        default=OPTIONS,
        metavar="OPTION",
        help="only these options (plain TCP, the ceiling, always runs); quoted names: " + ", ".join(OPTIONS),
    )
    args = parser.parse_args()
    options = tuple(dict.fromkeys((*args.options, "plain TCP")))
    load_before = os.getloadavg()
    torch.set_num_threads(1)  # conversions on the event loop thread; no intra-op thread pool spinning
    sizes, budget = (SIZES[:3], 0.1) if args.quick else (SIZES, 0.6)
    sizes, budget = tuple(args.sizes or sizes), args.budget or budget
    ctx = mp.get_context("fork")
    with _places(parser, args.netns) as (server_place, client_place):
        ours, theirs = ctx.Pipe()
        server = ctx.Process(target=_server_main, args=(theirs, server_place), daemon=True)
        server.start()
        try:
            maddrs, ports = ours.recv()
            work = (client_place, server_place, maddrs, ports, sizes, budget, options)
            results = _client_elsewhere(ctx, *work) if client_place.namespace else uvloop.run(_client(*work))
        finally:
            ours.send("stop")
            _stop(server)
    print(
        "Push one fp32 activation, get an ack: median ms per push, MiB/s of fp32 data, speed vs plain TCP\n"
    )
    print(_table(results, _speed))
    where = "between two network namespaces" if args.netns else "on loopback"
    print(f"\nCPU per push (both processes and both p2pd, {where}): ms, and as a multiple of plain TCP's\n")
    print(_table(results, _cpu))
    print("\nSerialise + deserialise one 32 MiB fp32 tensor in-process (best of 3)\n")
    print(_codec_table())
    load_after = os.getloadavg()
    print(
        f"\nLoad average (1, 5, 15 min) before: {load_before}, after: {load_after}, on {os.cpu_count()} CPUs"
    )
    if args.json is not None:
        machine = {"cpus": os.cpu_count(), "load_before": load_before, "load_after": load_after}
        args.json.write_text(json.dumps({"machine": machine, "rows": _rows(results)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
