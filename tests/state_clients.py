"""Hostile and joining clients of a swarm's state and averaging RPCs, run by `swarm_clients.py`:

    python swarm_clients.py {requester,averager,donor} PEERS_FILE RUN_ID ARGS...

torch and hivemind are imported inside them, so importing this module stays cheap.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

BURST = 8  # concurrent state requests of the requester's burst
POISONS = ("exp_avg", "clock", "lr_factor")  # what the hostile donor poisons, one per state request in turn


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def _ask_state(transport, run_id: str, peer: str, stage: int, parts) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """One state request: {"outcome": "ok"|"error"|"raised", "kind", "detail", "step", "tensors"}."""
    import torch
    from hivemind.p2p import PeerID

    from protocols.messages import Error, decode, encode
    from protocols.transfers import StateRequest, StateTransfer
    from swarmnode.node.state import unpack
    from swarmnode.transport import TransportError

    request = encode(StateRequest(run_id, stage, tuple(parts)))
    try:
        meta, tensors = await transport.call(PeerID.from_base58(peer), "state", request, [], timeout=30.0)
    except TransportError as error:
        return {"outcome": "raised", "kind": type(error).__name__, "detail": str(error)}
    message = decode(meta)
    if isinstance(message, Error):
        return {"outcome": "error", "kind": str(message.code), "detail": message.reason}
    assert isinstance(message, StateTransfer)
    received = unpack(message.tensors, tensors)
    flat = torch.cat([t.flatten().double() for t in received.values()])
    return {
        "outcome": "ok",
        "kind": "state_transfer",
        "step": message.step,
        "sum": float(flat.sum()),
        "largest": float(flat.abs().max()),
        "tensors": received,
    }


def requester_main(argv: Sequence[str]) -> int:
    """`python swarm_clients.py requester PEERS_FILE RUN_ID TARGET STAGE ANNOUNCE`

    ANNOUNCE "none": a stranger with no record; else a DHT state ("recovering") this client publishes at
    STAGE before it asks. It asks TARGET for STAGE's weights and optimizer once, then `BURST` times at once,
    and prints {"call": "single"|"burst", "outcome", "kind", "detail", "sum"} per answer, then
    {"event": "done"}.
    """
    import asyncio

    from swarm_clients import _announce, _run_client

    from protocols.transfers import StatePart
    from swarmnode.transport import Transport

    peers_file, run_id, target, stage_text, announce = argv
    stage = int(stage_text)
    parts = (StatePart.WEIGHTS, StatePart.OPTIMIZER)

    async def ask(p2p, dht) -> None:  # type: ignore[no-untyped-def]
        announcing = None
        if announce != "none":
            from protocols.messages import NodeRecord, NodeState

            await dht.publish(NodeRecord(state=NodeState(announce), stage=stage, step=0, outer_step=0), 4.0)
            announcing = asyncio.create_task(_announce(dht, stage, announce))
        transport = Transport(p2p)
        _say(event="ready", peer_id=str(p2p.peer_id))
        answers = [await _ask_state(transport, run_id, target, stage, parts)]
        answers += await asyncio.gather(
            *(_ask_state(transport, run_id, target, stage, parts) for _ in range(BURST))
        )
        for i, answer in enumerate(answers):
            answer.pop("tensors", None)
            _say(call="single" if i == 0 else "burst", **answer)
        await transport.close()
        if announcing is not None:
            announcing.cancel()
        _say(event="done")

    return _run_client(peers_file, run_id, ask)


def averager_main(argv: Sequence[str]) -> int:
    """`python swarm_clients.py averager PEERS_FILE RUN_ID TARGET STAGE`

    Announces itself recovering STAGE (so that TARGET shows it its weights), reads TARGET's weights, then
    sends two averaging requests for outer step 1: phi and theta of `1e30` ("poison"), and TARGET's own
    weights scaled by 1.01 ("near"). Prints {"call", "accept", "decline", "reason"} for each, then
    {"call": "after", "unchanged": bool, "finite": bool} comparing the weights read again, and
    {"event": "done"}.
    """
    import asyncio

    import torch
    from hivemind.p2p import PeerID
    from swarm_clients import _announce, _run_client

    from protocols.messages import AveragingReply, AveragingRequest, decode, encode
    from protocols.transfers import StatePart
    from swarmnode.node.state import manifest
    from swarmnode.transport import Transport

    peers_file, run_id, target, stage_text = argv
    stage = int(stage_text)

    async def attack(p2p, dht) -> None:  # type: ignore[no-untyped-def]
        from protocols.messages import NodeRecord, NodeState

        await dht.publish(NodeRecord(state=NodeState.RECOVERING, stage=stage, step=0, outer_step=0), 4.0)
        announcing = asyncio.create_task(_announce(dht, stage, "recovering"))
        transport = Transport(p2p)
        _say(event="ready", peer_id=str(p2p.peer_id))
        before = await _ask_state(transport, run_id, target, stage, (StatePart.WEIGHTS,))
        weights = before["tensors"]
        for call, phi in (
            ("poison", {n: torch.full_like(t, 1e30) for n, t in weights.items()}),
            ("near", {n: t * 1.01 for n, t in weights.items()}),
        ):
            request = AveragingRequest(run_id, stage, 1, manifest(phi), manifest(phi))
            tensors = list(phi.values()) * 2
            meta, _ = await transport.call(
                PeerID.from_base58(target), "average", encode(request), tensors, timeout=30.0
            )
            reply = decode(meta, AveragingReply)
            _say(call=call, accept=reply.accept, decline=str(reply.decline), reason=reply.reason)
        after = await _ask_state(transport, run_id, target, stage, (StatePart.WEIGHTS,))
        unchanged = all(torch.equal(t, weights[n]) for n, t in after["tensors"].items())
        finite = all(bool(torch.isfinite(t).all()) for t in after["tensors"].values())
        _say(call="after", unchanged=unchanged, finite=finite)
        await transport.close()
        announcing.cancel()
        _say(event="done")

    return _run_client(peers_file, run_id, attack)


def donor_main(argv: Sequence[str]) -> int:
    """`python swarm_clients.py donor PEERS_FILE RUN_ID STAGE STAGES STOP_FILE [copy]`

    A hostile donor of STAGE (of a tiny run of STAGES transformer stages): it publishes an `online` record
    for STAGE, answers `ping` with a Pong of STAGE, and every `state` request with the stage's initial
    weights and a poisoned optimizer state, the next of POISONS each time: Adam's exp_avg of `1e30`, a
    step of `2**63 - 1`, an lr factor of 10. With `copy`, every answer is the stage's weights with a NaN in
    the first (what a CheckFree+ holder of the stage's edge copy refreshes from), served as `nan_weights`.
    Prints {"event": "ready", "peer_id"}, {"served": POISON, "to": PEER, "parts": [...]} per state answer,
    and once STOP_FILE exists, {"event": "done"}.
    """
    import asyncio
    import itertools
    import time
    from pathlib import Path

    import torch
    from swarm_clients import _run_client

    from protocols.messages import NodeRecord, NodeState, Pong, Rpc, decode, encode
    from protocols.transfers import StateRequest, StateTransfer
    from swarmnode.node.state import manifest, weights
    from swarmnode.pieces import build_piece
    from swarmnode.presets import get_preset
    from swarmnode.transport import Transport

    peers_file, run_id, stage_text, stages_text, stop_file, *mode = argv
    stage, stop = int(stage_text), Path(stop_file)
    honest = weights(build_piece(get_preset("tiny").model, stage, int(stages_text)))
    poisons = itertools.cycle(("nan_weights",) if mode == ["copy"] else POISONS)

    def poisoned(poison: str) -> dict[str, torch.Tensor]:
        out = dict(honest)
        if poison == "nan_weights":
            first = next(iter(honest))
            return {**out, first: torch.full_like(honest[first], float("nan"))}
        for name, tensor in honest.items():
            big = 1e30 if poison == "exp_avg" else 0.0
            out[f"adam.{name}.step"] = torch.tensor(1.0)
            out[f"adam.{name}.exp_avg"] = torch.full_like(tensor, big)
            out[f"adam.{name}.exp_avg_sq"] = torch.zeros_like(tensor)
            out[f"outer.phi.{name}"] = tensor
        return out

    async def on_ping(peer, meta: bytes, tensors: list) -> tuple[bytes, list]:  # type: ignore[no-untyped-def]
        return encode(Pong(stage)), []

    async def on_state(peer, meta: bytes, tensors: list) -> tuple[bytes, list]:  # type: ignore[no-untyped-def]
        request = decode(meta, StateRequest)
        poison = next(poisons)
        out = {
            name: t for name, t in poisoned(poison).items() if name in honest or "optimizer" in request.parts
        }
        step = 2**63 - 1 if poison == "clock" else 1
        lr_factor = 10.0 if poison == "lr_factor" else 1.0
        header = StateTransfer(run_id, stage, request.parts, step, 0, 0.5, manifest(out), lr_factor)
        _say(served=poison, to=str(peer), parts=[str(part) for part in request.parts])
        return encode(header), list(out.values())

    async def serve(p2p, dht) -> None:  # type: ignore[no-untyped-def]
        transport = Transport(p2p)
        transport.register(Rpc.PING, on_ping)
        transport.register(Rpc.STATE, on_state)
        await transport.start()
        record = NodeRecord(state=NodeState.ONLINE, stage=stage, step=1, outer_step=0)
        await dht.publish(record, 4.0)
        _say(event="ready", peer_id=str(p2p.peer_id))
        deadline = time.monotonic() + 300
        while not stop.exists() and time.monotonic() < deadline:
            await dht.publish(record, 4.0)
            await asyncio.sleep(1.0)
        await transport.close()
        _say(event="done")

    return _run_client(peers_file, run_id, serve)


STATE_CLIENTS = {"requester": requester_main, "averager": averager_main, "donor": donor_main}
