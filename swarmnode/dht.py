"""A node's handle on the hivemind DHT: start it on loopback (or an explicit public address), publish this
node's record and the run definition, and read the swarm."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import tempfile
from collections.abc import Awaitable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, TypeVar

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from protocols.messages import NodeRecord, encode
from swarmnode import msgpack_guard
from swarmnode.dht_thread import DHTThread
from swarmnode.hivemind_parts import p2pd_flags
from swarmnode.identity import Identity
from swarmnode.records import (
    MAX_STAGES,
    PeerRecord,
    SwarmRecordValidator,
    decode_run,
    parse_stage_entries,
    peer_of_subkey,
    run_key,
    stage_key,
    subkey_of,
)
from swarmnode.relays import circuit_addrs
from swarmnode.runspec import RunSpec, RunSpecError, RunVersionMismatch

T = TypeVar("T")

logger = logging.getLogger(__name__)

DHT_CALL_TIMEOUT_S = 10.0  # every DHT call is bounded: a lookup whose peers stopped answering may not end
# A store puts a value on the NUM_REPLICAS peers nearest its key (hivemind's default count); stores and reads
# look for those peers with a beam that wide, not hivemind's default of 20 (every peer of a small swarm).
NUM_REPLICAS = 5
SHUTDOWN_TIMEOUT_S = 2.0  # for the DHT to leave and its p2pd to exit


async def _bounded(future: Awaitable[T]) -> T:
    """Await a DHT call for at most DHT_CALL_TIMEOUT_S."""
    return await asyncio.wait_for(future, DHT_CALL_TIMEOUT_S)


class RunNotFound(RuntimeError):
    """No valid run definition could be read from the DHT in time."""


class DHTUnavailable(RuntimeError):
    """The DHT could not start: no initial peer answered, or the address cannot be listened on."""


def read_initial_peers(value: str | None) -> list[str]:
    """Multiaddrs from `--initial-peers`: a comma/space separated list, or a file with one per line.

    Raises FileNotFoundError for a value that is neither, ValueError for an entry that is not a multiaddr
    ending in the peer's id (`/ip4/HOST/tcp/PORT/p2p/PEER_ID`, as `bootstrap` prints them)."""
    if not value:
        return []
    path = Path(value)
    source = "--initial-peers"
    if not value.startswith("/") or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"initial peers {value!r} is neither a multiaddr nor a readable file")
        value, source = path.read_text(), str(path)
    peers = [part for part in value.replace(",", " ").split() if part]
    for peer in peers:
        if _peer_id_of(peer) is None:
            raise ValueError(
                f"{peer[:200]!r} (from {source}) is not a multiaddr with a peer id, like "
                "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."
            )
    return peers


@dataclass(frozen=True)
class Reach:
    """How a node makes itself reachable, as passed to hivemind's libp2p daemon.

    announce_maddrs: the multiaddrs peers should dial (`/ip4/PUBLIC_IP/tcp/PORT`, with an explicit port),
        instead of the addresses listened on; for a port forwarded through a NAT.
    use_relay: dial peers through relays when they cannot be reached directly, and (where this node is
        publicly reachable) relay for others.
    use_auto_relay: behind a NAT: publish the circuit addresses of relays (`relays`, else the initial
        peers; `swarmnode.relays`), through which peers that cannot connect to this node open their
        streams (`transport._relay`); libp2p also reserves slots there while this node counts as private.
    reachability: "public" or "private" overrides libp2p's AutoNAT, which never decides on private
        address ranges; libp2p's own relay serves only while a node counts as public.
    relays: multiaddrs (ending in /p2p/ID) of the relays to be reached through, with `use_auto_relay`.
    """

    announce_maddrs: tuple[str, ...] = ()
    use_relay: bool = True
    use_auto_relay: bool = False
    reachability: Literal["auto", "public", "private"] = "auto"
    relays: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for addr in self.announce_maddrs:
            try:
                port = Multiaddr(addr).value_for_protocol("tcp")
            except Exception:  # multiaddr raises several unrelated types for bad input
                port = None
            if not port or port == "0":
                raise ValueError(
                    f"{addr[:200]!r} is not a multiaddr with an explicit TCP port, "
                    "like /ip4/203.0.113.7/tcp/31337"
                )
        for addr in self.relays:
            if _peer_id_of(addr) is None:
                raise ValueError(f"relay {addr[:200]!r} is not a multiaddr with a peer id")
        if self.relays and not self.use_auto_relay:
            raise ValueError("relays are used only with use_auto_relay")
        if self.use_auto_relay and not self.use_relay:
            raise ValueError("use_auto_relay needs use_relay")

    def p2p_kwargs(self, initial_peers: Sequence[str]) -> dict[str, Any]:
        """Keyword arguments of `hivemind.P2P.create`."""
        kwargs: dict[str, Any] = {"use_relay": self.use_relay, "use_auto_relay": self.use_auto_relay}
        if self.announce_maddrs:
            kwargs["announce_maddrs"] = list(self.announce_maddrs)
        if self.reachability != "auto":
            kwargs["force_reachability"] = self.reachability
        if relays := self.static_relays(initial_peers):
            kwargs["trusted_relays"] = list(relays)
        return kwargs

    def static_relays(self, initial_peers: Sequence[str]) -> tuple[str, ...]:
        """The relays this node reserves slots on: with `use_auto_relay`, `relays`, else the initial peers."""
        return tuple(self.relays or initial_peers) if self.use_auto_relay else ()

    def p2pd_flags(self, initial_peers: Sequence[str]) -> dict[str, bool]:
        """p2pd flags that hivemind's `P2P.create` does not pass (`hivemind_parts.p2pd_flags`). With static
        relays, libp2p's discovery of further relays is off: it waits for four candidates (or three
        minutes) before reserving any slot, and leaves the node unable to tell peers which relay it holds."""
        return {"relayDiscovery": False} if self.static_relays(initial_peers) else {}

    def announced_ports(self) -> tuple[int, ...]:
        """The TCP ports named by `announce_maddrs`, in order, without repeats."""
        ports = (int(Multiaddr(addr).value_for_protocol("tcp")) for addr in self.announce_maddrs)
        return tuple(dict.fromkeys(ports))


def peer_ids_of(addresses: Sequence[str]) -> list[PeerID]:
    """The peer ids that multiaddrs end in (those without one left out), without repeats."""
    return list(dict.fromkeys(peer for peer in map(_peer_id_of, addresses) if peer is not None))


def _peer_id_of(address: str) -> PeerID | None:
    try:
        return PeerID.from_base58(Multiaddr(address).value_for_protocol("p2p"))
    except Exception:  # multiaddr raises several unrelated types for bad input
        return None


@contextlib.contextmanager
def _identity_file(identity: Identity, path: Path | None) -> Iterator[Path]:
    """The key file p2pd reads at start: `path` if given (it already holds `identity`), else a private
    temporary file, removed once p2pd has started."""
    if path is not None:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="swarmnode-id-") as folder:
        key_file = Path(folder) / "identity.key"
        identity.save(key_file)
        yield key_file


def _start_failure(message: str, host: str, port: int) -> str:
    """One line for a p2pd that did not start, from its message (`Daemon failed to start: DATE TIME why`)."""
    why = re.sub(r"^.*?failed to start:\s*(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\s*)?", "", message).strip()
    if "bootstrap peers" in why:
        return f"no initial peer answered ({why}): check --initial-peers and that those peers are up"
    if "listen" in why:
        return f"cannot listen on {host}:{port} ({why.rsplit(': ', 1)[-1].strip('[] ')})"
    return f"the p2p daemon did not start: {why or message}"


async def _latest_values(keys: tuple[str, ...], node: DHTNode) -> dict[str, ValueWithExpiration[Any] | None]:
    """Run on the DHT's loop: the latest value of each key (as `DHTNode.get(latest=True)` finds it), all keys
    in one traversal."""
    found = await node.get_many(keys, sufficient_expiration_time=float("inf"), beam_size=NUM_REPLICAS)
    return {key: found[key] for key in keys}


def _entries(found: ValueWithExpiration[Any] | None) -> list[tuple[Any, ValueWithExpiration[Any]]]:
    """(subkey, item) pairs of a dictionary value found on the DHT; none for anything else."""
    if found is None or not isinstance(found.value, dict):
        return []
    return list(found.value.items())


class SwarmDHT:
    """One DHT peer (a thread of this process, `DHTThread`, and its p2pd), with the run's validator installed.

    The node's key is read from `identity_path` (created there if missing, so the peer id survives
    restarts) or made fresh: p2pd takes it as its libp2p identity, and the validator signs this node's
    records with it. `run_owners` are the peer ids whose run definition this node
    accepts (by default the peers named in `initial_peers`: the bootstrap's address names the run's owner).
    `reach`: announced addresses and relays (`Reach`); by default hivemind's (relays used, none reserved).
    `thread` runs the DHT node (`DHTThread.call` hands it a coroutine of the node).
    """

    def __init__(
        self,
        run_id: str,
        initial_peers: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        public: bool = False,
        client_mode: bool = False,
        identity_path: Path | None = None,
        run_owners: Sequence[str] = (),
        reach: Reach | None = None,
    ) -> None:
        self.run_id = run_id
        self.reach = reach or Reach()
        msgpack_guard.install()  # before the DHT starts: hivemind's own handlers decode peer bytes
        self.identity = Identity.load_or_create(identity_path) if identity_path else Identity.generate()
        self.run_owners = frozenset(run_owners) or frozenset(
            str(peer) for peer in map(_peer_id_of, initial_peers) if peer is not None
        )
        self._ignored_runs: set[str] = set()
        # where peers that cannot dial this node reach it (`NodeRecord.addrs`)
        self.circuit_addrs = circuit_addrs(self.reach.static_relays(initial_peers))
        flags = self.reach.p2pd_flags(initial_peers)
        with _identity_file(self.identity, identity_path) as key_file, p2pd_flags(flags):
            try:
                self.thread = DHTThread(
                    [SwarmRecordValidator(run_id, self.identity)],
                    initial_peers,
                    client_mode,
                    {
                        "host_maddrs": [f"/ip4/{host}/tcp/{port}"],
                        "nat_port_map": public,
                        "identity_path": str(key_file),
                        # hivemind's check reads the key file as RSA only (`PeerID.from_identity`): with an
                        # Ed25519 identity every `join --identity` failed, "Could not deserialize key data"
                        "check_if_identity_free": False,
                        **self.reach.p2p_kwargs(initial_peers),
                    },
                    # every read here asks for the latest value, so hivemind's background re-read of cached
                    # keys (due 5 s before they expire: at once for a 4 s record) is lookups for nothing
                    cache_refresh_before_expiry=0,
                    # nor a copy of each value read sent to a nearest peer that lacked it (a store for most
                    # reads, as records change every period): reads ask the replicas themselves
                    cache_nearest=0,
                    num_replicas=NUM_REPLICAS,
                )
            except P2PDaemonError as error:  # p2pd exited at start: its last words say why
                raise DHTUnavailable(_start_failure(str(error), host, port)) from None
        self.peer_id = str(self.thread.peer_id)
        self._p2p: P2P | None = None
        self._subkey = subkey_of(self.peer_id)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def p2pd_pid(self) -> int:
        return self.thread.p2pd_pid

    @property
    def p2pd_exit_code(self) -> int | None:
        return self.thread.p2pd_exit_code

    def visible_maddrs(self, latest: bool = False) -> list[str]:
        """This node's multiaddrs as its p2pd gives them (`latest`: asked now, not as cached at start)."""
        maddrs = self.thread.call_blocking(
            lambda node: node.get_visible_maddrs(latest=latest), DHT_CALL_TIMEOUT_S
        )
        return [str(addr) for addr in maddrs]

    async def publish(self, record: NodeRecord, ttl: float) -> bool:
        return await self.store(stage_key(self.run_id, record.stage), encode(record), ttl)

    async def publish_run(self, spec: RunSpec, ttl: float) -> bool:
        return await self.store(run_key(self.run_id), MSGPackSerializer.dumps(spec.to_dict()), ttl)

    async def store(self, key: str, value: bytes, ttl: float) -> bool:
        """Store `value` under this node's subkey of `key` for `ttl` s; whether the DHT took it."""
        expiration = get_dht_time() + ttl
        return await _bounded(
            self.thread.call(
                lambda node: node.store(key, value, expiration, subkey=self._subkey, beam_size=NUM_REPLICAS)
            )
        )

    async def get_latest(self, key: str) -> ValueWithExpiration[Any] | None:
        """The latest value of `key` on the DHT (for a dictionary, every subkey's latest), or None."""
        return await _bounded(
            self.thread.call(lambda node: node.get(key, latest=True, beam_size=NUM_REPLICAS))
        )

    async def read_run(self) -> RunSpec | None:
        """The newest valid run definition published by one of `run_owners`; others are ignored (logged
        once per publisher). RunVersionMismatch if the owner's definition is of a swarmnode this one cannot
        join (and none is of this one)."""
        found = await self.get_latest(run_key(self.run_id))
        if found is None or not isinstance(found.value, dict):
            return None
        owned = []
        for subkey, item in found.value.items():
            publisher = peer_of_subkey(subkey)
            if publisher in self.run_owners:
                owned.append(item)
            elif publisher is not None and publisher not in self._ignored_runs:
                self._ignored_runs.add(publisher)
                logger.warning(
                    "ignoring a definition of run %r published by %s, which is not the run's owner (%s)",
                    self.run_id,
                    publisher,
                    ", ".join(sorted(self.run_owners)) or "none given",
                )
        mismatch: RunVersionMismatch | None = None
        for item in sorted(owned, key=lambda item: item.expiration_time, reverse=True):
            try:
                return decode_run(item.value)
            except RunVersionMismatch as error:
                mismatch = mismatch or error
            except RunSpecError:
                continue
        if mismatch is not None:
            raise mismatch
        return None

    async def wait_for_run(self, timeout: float) -> RunSpec:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            spec = await self.read_run()
            if spec is not None:
                return spec
            if asyncio.get_running_loop().time() > deadline:
                owners = ", ".join(sorted(self.run_owners)) or "no owner given"
                raise RunNotFound(
                    f"no run definition for run {self.run_id!r} from its owner ({owners}) on the DHT after "
                    f"{timeout:.0f} s; join through the bootstrap's address, or name it with --run-owner"
                )
            await asyncio.sleep(0.5)

    async def read_stage(self, stage: int) -> list[PeerRecord]:
        """The live records of one stage."""
        return (await self.read_stages((stage,)))[stage]

    async def read_swarm(self, n_stages: int) -> dict[int, list[PeerRecord]]:
        """Every stage's live records, stages 0..n_stages."""
        if not 0 <= n_stages <= MAX_STAGES:
            raise ValueError(f"n_stages must be within 0..{MAX_STAGES}")
        return await self.read_stages(range(n_stages + 1))

    async def read_stages(self, stages: Iterable[int]) -> dict[int, list[PeerRecord]]:
        """The live records of each of `stages`, their keys looked up in one traversal of the DHT (each peer
        asked once for all of them, not once a key: a node reads every stage every record period)."""
        keys = {stage_key(self.run_id, k): k for k in stages}
        found = await _bounded(self.thread.call(partial(_latest_values, tuple(keys))))
        now = get_dht_time()
        return {
            stage: parse_stage_entries(
                (subkey, item.value, item.expiration_time)
                for subkey, item in _entries(found.get(key))
                if item.expiration_time > now
            )
            for key, stage in keys.items()
        }

    async def replicate_p2p(self) -> P2P:
        """This process's client of the DHT's p2pd (one per process, shared by every user of it)."""
        if self._p2p is None:
            self._p2p = await P2P.replicate(self.thread.daemon_listen_maddr)
        return self._p2p

    async def close(self) -> None:
        """Shut down the p2pd client (it removes its socket file), then the DHT thread and its p2pd."""
        if self._p2p is not None:
            await self._p2p.shutdown()
            self._p2p = None
        self.shutdown()

    def shutdown(self) -> None:
        self.thread.shutdown(SHUTDOWN_TIMEOUT_S)
