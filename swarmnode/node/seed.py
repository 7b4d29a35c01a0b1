"""A run that starts from weights (`bootstrap --init-from DIR`): the bootstrap serves them, nodes fetch them.

The bootstrap reads a Hugging Face Llama folder (`modeldir`), splits it into the run's stages and publishes
one SHA-256 digest per stage in the run definition (`RunSpec.init_digests`). It then answers state requests
for any stage's weights (step 0, nothing else) from the memory it loaded once. A node that starts in a run
that has not trained yet (`recovery.recover` found nothing to recover) asks the bootstrap (the run's owner)
for its stage's weights and loads them only if their digest is the published one: the bytes are the owner's
whoever relayed them. Later joiners copy a live replica or are rebuilt, as in every run.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch
from hivemind.p2p import PeerID
from torch import Tensor

from protocols.errors import ProtocolError
from protocols.messages import Error, ErrorCode, Rpc, bounded, decode, encode
from protocols.transfers import StatePart, StateRequest, StateTransfer
from swarmnode.dht import SwarmDHT
from swarmnode.modeldir import check_shape, load_pieces, read_model_folder
from swarmnode.node import state
from swarmnode.node.checks import Rejected, decode_from_peer
from swarmnode.node.compute import ComputeQueue, Priority
from swarmnode.node.events import emit
from swarmnode.pieces import build_piece
from swarmnode.presets import get_preset
from swarmnode.runspec import RunSpec
from swarmnode.transport import Reply, Transport, TransportError

logger = logging.getLogger(__name__)

MAX_SEED_TRANSFERS = 4  # weights of step 0, served from memory: a few at once, the rest try again
FETCH_ATTEMPTS = 5
FETCH_TIMEOUT_S = 60.0


class SeedJoiner(Protocol):
    """What starting from the run's initial weights needs of a node."""

    spec: RunSpec
    stage: int
    dht: SwarmDHT
    transport: Transport
    compute: ComputeQueue
    piece: torch.nn.Module

    @property
    def outer(self) -> _OuterPhi: ...


class _OuterPhi(Protocol):
    phi: state.TensorMap


class SeedError(Exception):
    """The run's initial weights could not be read, served or fetched intact."""


def digest(tensors: state.TensorMap) -> str:
    """SHA-256 over each tensor's name, dtype, shape and bytes, in name order."""
    sha = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        sha.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        sha.update(tensor.view(torch.uint8).reshape(-1).numpy().tobytes())
    return sha.hexdigest()


@dataclass(frozen=True)
class SeedWeights:
    """Every stage's weights (0: the data stage's E and E'), named as the stage's piece names them."""

    stages: tuple[state.TensorMap, ...]

    @property
    def digests(self) -> tuple[str, ...]:
        return tuple(digest(weights) for weights in self.stages)


def read_seed(folder: Path, spec: RunSpec) -> SeedWeights:
    """The weights of `folder` split into `spec`'s stages; ModelFolderError names what does not fit."""
    expected = replace(get_preset(spec.preset).model, vocab_size=spec.vocab_size)
    found, split = read_model_folder(folder, spec.stages)
    check_shape(found, expected, f"the run (preset {spec.preset!r}, vocabulary {spec.vocab_size})")
    pieces = [build_piece(expected, k, spec.stages) for k in range(spec.stages + 1)]
    load_pieces(pieces, split)
    return SeedWeights(tuple(state.weights(piece) for piece in pieces))


class SeedServer:
    """The bootstrap's answer to state requests: a stage's initial weights, to anyone of the run."""

    def __init__(self, spec: RunSpec, seed: SeedWeights) -> None:
        self.spec = spec
        self.seed = seed
        self._serving = 0

    def register(self, transport: Transport) -> None:
        transport.register(Rpc.STATE, self.serve, max_body_bytes=0)

    async def serve(
        self, peer: PeerID, meta: bytes, tensors: list[Tensor]
    ) -> tuple[bytes, list[Tensor]] | Reply:
        try:
            request = decode_from_peer(meta, StateRequest, self.spec.run_id)
            self._check(request)
        except Rejected as rejected:
            logger.info("initial weights refused to %s: %s", str(peer)[-8:], rejected.reason)
            return encode(Error(rejected.code, bounded(rejected.reason))), []
        weights = self.seed.stages[request.stage]
        header = StateTransfer(
            self.spec.run_id, request.stage, request.parts, 0, 0, None, state.manifest(weights)
        )
        self._serving += 1
        return Reply(encode(header), list(weights.values()), lambda _: self._release())

    def _release(self) -> None:
        self._serving -= 1

    def _check(self, request: StateRequest) -> None:
        if request.parts != (StatePart.WEIGHTS,) or not 0 <= request.stage <= self.spec.stages:
            why = "the bootstrap serves only the initial weights of the run's stages"
            raise Rejected(ErrorCode.WRONG_STAGE, why)
        if self._serving >= MAX_SEED_TRANSFERS:
            raise Rejected(
                ErrorCode.BUSY, f"{MAX_SEED_TRANSFERS} transfers of the initial weights in progress"
            )


async def fetch_seed(
    transport: Transport, spec: RunSpec, stage: int, owners: Iterable[str], expected: str
) -> state.TensorMap:
    """Stage `stage`'s initial weights from one of the run's `owners`, checked against the digest the run
    definition publishes; SeedError if none delivers them intact after a few tries."""
    problems: list[str] = []
    for attempt in range(FETCH_ATTEMPTS):
        for owner in sorted(owners):
            try:
                meta, tensors = await transport.call(
                    PeerID.from_base58(owner),
                    Rpc.STATE,
                    encode(StateRequest(spec.run_id, stage, (StatePart.WEIGHTS,))),
                    [],
                    timeout=FETCH_TIMEOUT_S,
                )
                header = decode(meta)
                if isinstance(header, Error):
                    raise SeedError(f"{header.code}: {header.reason}")
                if not isinstance(header, StateTransfer) or header.stage != stage:
                    raise SeedError(f"answered a {type(header).__name__}, not stage {stage}'s weights")
                weights = state.unpack(header.tensors, tensors)
                if digest(weights) != expected:
                    raise SeedError("the weights do not match the digest the run definition publishes")
                return weights
            except (SeedError, TransportError, ProtocolError, ValueError, state.StateMismatch) as error:
                problems.append(f"{owner[-8:]}: {error}")
                logger.warning("initial weights of stage %d from %s: %s", stage, owner[-8:], error)
        await asyncio.sleep(min(4.0, 0.5 * 2**attempt))
    last = "; ".join(problems[-2:])
    raise SeedError(f"no owner of the run delivered stage {stage}'s initial weights ({last})")


async def start_from_seed(node: SeedJoiner) -> None:
    """A run that starts from weights and has not trained yet: load this stage's initial weights, fetched
    from the run's owner and checked against the run definition's digest."""
    expected = node.spec.init_digest(node.stage)
    if expected is None:
        raise SeedError(f"run {node.spec.run_id!r} does not start from weights")
    weights = await fetch_seed(node.transport, node.spec, node.stage, node.dht.run_owners, expected)

    def load() -> None:
        state.load_weights(node.piece, weights)
        node.outer.phi = state.weights(node.piece)

    await node.compute.submit(Priority.STEP, load)
    emit("seeded", stage=node.stage, digest=expected)
