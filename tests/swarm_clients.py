"""The tests' clients of a swarm, each run as a separate process by `LocalTestSwarm.client`:

    python swarm_clients.py {hostile,weights,links,requester,averager,donor} PEERS_FILE RUN_ID ARGS...

`hostile_main` is a hostile peer that sends bad "forward" calls; `links_main` prints whom each node's
record carries link costs to; `weights_main` observes two replicas'
weights (announcing itself as a node recovering their stage: state goes to joiners only); the state and
averaging clients, and a hostile donor, are in state_clients.py. hivemind and torch are imported inside
them, so importing this module (for `CLIENTS`) stays cheap.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from state_clients import STATE_CLIENTS

VALID_ATTEMPTS = 10  # the hostile peer's tries of its valid-looking call (see hostile_main)
WEIGHTS_PERIOD_S = 0.1  # how often the weights observer asks both replicas for their weights


def _client_dht(peers_file: str, run_id: str):  # type: ignore[no-untyped-def]
    """A DHT client of the run on loopback, no NAT port mapping (hivemind imported here, not by pytest)."""
    from swarmnode.dht import SwarmDHT, read_initial_peers

    return SwarmDHT(run_id, read_initial_peers(peers_file), client_mode=True)


async def _announce(dht, stage: int, state: str) -> None:  # type: ignore[no-untyped-def]
    """Publish a record saying this client is `state` at `stage` (as a joiner would), every second."""
    import asyncio

    from protocols.messages import NodeRecord, NodeState

    record = NodeRecord(state=NodeState(state), stage=stage, step=0, outer_step=0)
    while True:
        await dht.publish(record, 4.0)
        await asyncio.sleep(1.0)


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def hostile_main(argv: Sequence[str]) -> int:
    """`python swarm_clients.py hostile PEERS_FILE RUN_ID DIM GO_FILE STAGE:PEER_ID:ATTACK ...`

    Joins the run's DHT as a client and waits for GO_FILE to exist. Then, for each target, it sends one bad
    "forward" (ATTACK: garbage, nan or shape) and then a valid-looking one, printing one JSON line per call:
    {"target", "stage", "attack", "call": "bad"|"valid", "outcome": "error"|"raised"|"ok", "kind", "detail"}.
    Its first line is {"event": "ready", "peer_id": ...}, its last {"event": "done"}.
    """
    import asyncio

    import torch
    from hivemind.p2p import PeerID

    from protocols.hops import Forward
    from protocols.manifest import TensorSpec
    from protocols.messages import Error, decode, encode
    from swarmnode.transport import RemoteError, Transport, TransportError

    peers_file, run_id, width_text, go_file, *targets = argv
    width = int(width_text)  # the model's hidden size: a valid-looking tensor is (1, 16, width)
    go = Path(go_file)

    async def call(transport: Transport, peer: str, meta: bytes, tensors: list[torch.Tensor]) -> dict:
        try:
            reply, _ = await transport.call(PeerID.from_base58(peer), "forward", meta, tensors, timeout=20.0)
        except RemoteError as error:
            return {"outcome": "raised", "kind": error.kind, "detail": error.message}
        except TransportError as error:
            return {"outcome": "raised", "kind": type(error).__name__, "detail": str(error)}
        try:
            message = decode(reply)
        except Exception as error:  # an unreadable reply counts as refused too, but say so
            return {"outcome": "raised", "kind": "undecodable_reply", "detail": str(error)}
        if isinstance(message, Error):
            return {"outcome": "error", "kind": str(message.code), "detail": message.reason}
        return {"outcome": "ok", "kind": type(message).__name__, "detail": ""}

    def forward(me: str, peer: str, stage: int, shape: tuple[int, ...], iteration: int) -> bytes:
        spec = (TensorSpec("hidden", shape, "float32"),)
        return encode(Forward(run_id, iteration, 0, (me, peer, me), 1, (0, stage, 0), (1, 1, 1), spec))

    async def attack(p2p, dht) -> None:  # type: ignore[no-untyped-def]
        transport = Transport(p2p)
        me = str(p2p.peer_id)
        _say(event="ready", peer_id=me)
        deadline = time.monotonic() + 120
        while not go.exists():  # the test says when to attack (for example: once training runs)
            if time.monotonic() > deadline:
                raise SystemExit("no go signal")
            await asyncio.sleep(0.1)
        good = (1, 16, width)
        for target in targets:
            stage_text, peer, kind = target.split(":")
            stage = int(stage_text)
            if kind == "garbage":
                meta, tensors = b"\xc1\xff not msgpack at all", [torch.zeros(good)]
            elif kind == "nan":
                meta, tensors = forward(me, peer, stage, good, 10**9), [torch.full(good, float("nan"))]
            elif kind == "shape":
                bad = (1, 16, width + 3)
                meta, tensors = forward(me, peer, stage, bad, 10**9), [torch.zeros(bad)]
            else:
                raise SystemExit(f"unknown attack {kind!r}")
            result = await call(transport, peer, meta, tensors)
            _say(target=peer, stage=stage, attack=kind, call="bad", **result)
            valid = forward(me, peer, stage, good, 10**9 + 1), [torch.randn(good)]
            # A refusal can reach us as a broken stream instead of the "banned" answer: the server closes
            # the stream after reading only the frame's prefix, our next write fails, and asyncio's reader
            # then raises that error instead of returning the answer it holds. So try a few fresh streams.
            attempts = []
            for _ in range(VALID_ATTEMPTS):
                attempts.append(await call(transport, peer, *valid))
                if attempts[-1]["kind"] != "PeerUnreachable":
                    break
                await asyncio.sleep(0.2)
            _say(target=peer, stage=stage, attack=kind, call="valid", **attempts[-1], attempts=attempts)
        await transport.close()
        _say(event="done")

    return _run_client(peers_file, run_id, attack)


def weights_main(argv: Sequence[str]) -> int:
    """`python swarm_clients.py weights PEERS_FILE RUN_ID STAGE STOP_FILE PEER_A PEER_B`

    Until STOP_FILE exists, asks both replicas for their weights (the "state" RPC a newcomer uses) every
    WEIGHTS_PERIOD_S, keeping the first copy it sees after each of their steps, and, once per outer step,
    their NoLoCo slow weights phi (in the "optimizer" part). Then it prints one JSON line per step both were
    seen at, {"step", "outer": [outer step of a, of b], "distance": |theta_a - theta_b|, "norm": |theta_a|},
    one per outer step both were seen at, {"outer_step", "phi_distance": |phi_a - phi_b|, "phi_norm"}, and
    finally {"event": "done", "rounds": n}.
    """
    import asyncio

    import torch
    from hivemind.p2p import PeerID

    from protocols.errors import ProtocolError
    from protocols.messages import decode, encode
    from protocols.transfers import StatePart, StateRequest, StateTransfer
    from swarmnode.node.state import unpack
    from swarmnode.transport import Transport, TransportError

    peers_file, run_id, stage_text, stop_file, *peers = argv
    stage = int(stage_text)
    stop = Path(stop_file)
    thetas: dict[str, dict[int, tuple[int, torch.Tensor]]] = {peer: {} for peer in peers}
    phis: dict[str, dict[int, torch.Tensor]] = {peer: {} for peer in peers}

    async def fetch(transport: Transport, peer: str, part: StatePart) -> tuple[StateTransfer, dict] | None:
        request = encode(StateRequest(run_id, stage, (part,)))
        try:
            meta, tensors = await transport.call(PeerID.from_base58(peer), "state", request, [], timeout=20.0)
            header = decode(meta, StateTransfer)
        except (TransportError, ProtocolError, ValueError):
            return None  # not online yet, busy, or its record not seen yet: next round
        return header, unpack(header.tensors, tensors)

    def flat(tensors: dict) -> torch.Tensor:
        return torch.cat([tensors[name].flatten().double() for name in sorted(tensors)])

    async def sample(transport: Transport, peer: str) -> None:
        got = await fetch(transport, peer, StatePart.WEIGHTS)
        if got is None:
            return
        header, weights = got
        thetas[peer].setdefault(header.step, (header.outer_step, flat(weights)))
        if header.outer_step not in phis[peer]:
            got = await fetch(transport, peer, StatePart.OPTIMIZER)
            if got is not None:
                prefix = "outer.phi."
                phi = {name: t for name, t in got[1].items() if name.startswith(prefix)}
                phis[peer].setdefault(got[0].outer_step, flat(phi))

    async def observe(p2p, dht) -> None:  # type: ignore[no-untyped-def]
        announcing = asyncio.create_task(_announce(dht, stage, "recovering"))  # state goes to joiners only
        transport = Transport(p2p)
        _say(event="ready", peer_id=str(p2p.peer_id))
        deadline = time.monotonic() + 600
        rounds = 0
        while not stop.exists() and time.monotonic() < deadline:
            await asyncio.gather(*(sample(transport, peer) for peer in peers))
            rounds += 1
            await asyncio.sleep(WEIGHTS_PERIOD_S)
        await transport.close()
        announcing.cancel()
        a, b = (thetas[peer] for peer in peers)
        for step in sorted(set(a) & set(b)):
            (outer_a, theta_a), (outer_b, theta_b) = a[step], b[step]
            distance = float((theta_a - theta_b).norm())
            _say(step=step, outer=[outer_a, outer_b], distance=distance, norm=float(theta_a.norm()))
        a, b = (phis[peer] for peer in peers)
        for outer in sorted(set(a) & set(b)):
            phi_distance = float((a[outer] - b[outer]).norm())
            _say(outer_step=outer, phi_distance=phi_distance, phi_norm=float(a[outer].norm()))
        _say(event="done", rounds=rounds)

    return _run_client(peers_file, run_id, observe)


def links_main(args: Sequence[str]) -> int:
    """`links PEERS_FILE RUN_ID STAGES`: print one line per node of the run, with the peers its record
    carries link costs to (`NodeRecord.links`)."""
    peers_file, run_id, stages = args[0], args[1], int(args[2])

    async def read(p2p, dht) -> None:  # type: ignore[no-untyped-def]
        for stage, peers in (await dht.read_swarm(stages)).items():
            for peer in peers:
                _say(stage=stage, peer_id=peer.peer_id, links=[cost.peer for cost in peer.record.links])
        _say(event="done")

    return _run_client(peers_file, run_id, read)


def _run_client(peers_file: str, run_id: str, body) -> int:  # type: ignore[no-untyped-def]
    """Run `body(p2p, dht)` on a fresh DHT client's P2P; shut both down whatever happens."""
    import asyncio

    async def main(dht) -> None:  # type: ignore[no-untyped-def]
        try:
            await body(await dht.replicate_p2p(), dht)
        finally:
            await dht.close()  # the P2P replica's client socket file goes with it

    dht = _client_dht(peers_file, run_id)
    try:
        asyncio.run(main(dht))
    finally:
        dht.shutdown()
    return 0


CLIENTS = {"hostile": hostile_main, "weights": weights_main, "links": links_main, **STATE_CLIENTS}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in CLIENTS:
        raise SystemExit(f"usage: {sys.argv[0]} {{{','.join(CLIENTS)}}} ARGS... (see their docstrings)")
    raise SystemExit(CLIENTS[sys.argv[1]](sys.argv[2:]))
