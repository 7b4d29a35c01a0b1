"""The run's tokenizer travels by digest: served by the bootstrap and the data nodes, fetched when missing.

The run definition names its tokenizer by digest (`RunSpec.tokenizer_digest`, `tokenizer.file_digest`).
The bootstrap and every data node serve the file they tokenise with (`TokenizerServer`, `Rpc.TOKENIZER`).
A data node started without `--tokenizer` uses the file with that digest from its cache
(`tokenizers/{digest}.json`, or the default tokenizer it trained before), and otherwise asks the run's owners,
then the data nodes online, for it (`fetch_tokenizer`). The bytes travel beside a `TokenizerTransfer` header
as one int32 tensor (the file zero-padded to a multiple of 4 bytes); a file whose digest is not the one
asked for is rejected and logged, never used or cached.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from hivemind.p2p import PeerID
from torch import Tensor

from protocols.errors import ProtocolError
from protocols.messages import Error, ErrorCode, NodeState, Rpc, bounded, decode, encode
from protocols.transfers import MAX_TOKENIZER_BYTES, TokenizerRequest, TokenizerTransfer
from swarmnode.datasource import DataError, atomic_write, file_lock
from swarmnode.dht import SwarmDHT
from swarmnode.node.checks import Rejected, decode_from_peer
from swarmnode.runspec import RunSpec
from swarmnode.tokenizer import DIGEST_CHARS, load_tokenizer
from swarmnode.transport import Limits, Transport, TransportConfig, TransportError

logger = logging.getLogger(__name__)

FETCH_ATTEMPTS = 3
FETCH_TIMEOUT_S = 30.0
TOKENIZER_FOLDER = "tokenizers"  # under the cache folder: `{digest}.json`
# a reply larger than the largest tokenizer (and its header) is dropped before it is read
FETCH_CONFIG = TransportConfig(
    limits=Limits(max_message_bytes=MAX_TOKENIZER_BYTES + (1 << 20), max_tensors=1)
)


class TokenizerFetchError(DataError):
    """No peer delivered the run's tokenizer intact."""


def digest_of(data: bytes) -> str:
    """The digest `tokenizer.file_digest` gives a file of these bytes."""
    return hashlib.sha256(data).hexdigest()[:DIGEST_CHARS]


def pack(data: bytes) -> Tensor:
    """`data` zero-padded to a multiple of 4 bytes, as a 1-D int32 tensor (a dtype the transport carries)."""
    padded = bytearray(data) + bytes(-len(data) % 4)
    return torch.frombuffer(padded, dtype=torch.uint8).view(torch.int32)


def unpack(tensors: list[Tensor], size: int) -> bytes:
    """The `size` bytes packed by `pack`; ValueError if `tensors` is not one such tensor."""
    if len(tensors) != 1:
        raise ValueError(f"expected one tensor, got {len(tensors)}")
    tensor = tensors[0]
    if tensor.dtype != torch.int32 or tensor.dim() != 1 or tensor.numel() != (size + 3) // 4:
        raise ValueError(f"expected {(size + 3) // 4} int32 values, got {tensor.dtype} {tuple(tensor.shape)}")
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()[:size]


class TokenizerServer:
    """Answers `Rpc.TOKENIZER` with the tokenizer.json at `path` (read once), to anyone of the run."""

    def __init__(self, run_id: str, path: Path) -> None:
        data = path.read_bytes()
        if len(data) > MAX_TOKENIZER_BYTES:
            raise DataError(f"{path}: {len(data)} bytes, over the {MAX_TOKENIZER_BYTES} a tokenizer may have")
        self.run_id = run_id
        self.digest = digest_of(data)
        self._size = len(data)
        self._packed = pack(data)

    def register(self, transport: Transport) -> None:
        transport.register(Rpc.TOKENIZER, self.serve, max_body_bytes=0)

    async def serve(self, peer: PeerID, meta: bytes, tensors: list[Tensor]) -> tuple[bytes, list[Tensor]]:
        try:
            request = decode_from_peer(meta, TokenizerRequest, self.run_id)
            if request.digest != self.digest:
                why = f"this node's tokenizer is {self.digest}, not {request.digest}"
                raise Rejected(ErrorCode.WRONG_RUN, why)
        except Rejected as rejected:
            logger.info("tokenizer refused to %s: %s", str(peer)[-8:], rejected.reason)
            return encode(Error(rejected.code, bounded(rejected.reason))), []
        return encode(TokenizerTransfer(self.run_id, self.digest, self._size)), [self._packed]


def cached_path(cache: Path, digest: str) -> Path:
    """Where a fetched tokenizer with `digest` is kept."""
    return cache / TOKENIZER_FOLDER / f"{digest}.json"


def find_cached(digest: str, candidates: Iterable[Path]) -> Path | None:
    """The first existing file among `candidates` whose digest is `digest`."""
    for path in candidates:
        if path.is_file() and digest_of(path.read_bytes()) == digest:
            return path
    return None


async def fetch_tokenizer(
    transport: Transport, run_id: str, digest: str, peers: Iterable[str], cache: Path
) -> Path:
    """The tokenizer with `digest`, fetched from the first of `peers` that delivers it intact, checked and
    cached (`cached_path`); TokenizerFetchError naming the last problems if none does after a few rounds."""
    request = encode(TokenizerRequest(run_id, digest))
    order = list(dict.fromkeys(peers))
    problems: list[str] = []
    for attempt in range(FETCH_ATTEMPTS):
        for peer in order:
            try:
                meta, tensors = await transport.call(
                    PeerID.from_base58(peer), Rpc.TOKENIZER, request, [], timeout=FETCH_TIMEOUT_S
                )
                data = _check_reply(meta, tensors, run_id, digest)
            except (TokenizerFetchError, TransportError, ProtocolError, ValueError) as error:
                problems.append(f"{peer[-8:]}: {error}")
                logger.warning("the run's tokenizer %s from %s: %s", digest, peer[-8:], error)
                continue
            logger.info("fetched the run's tokenizer %s from %s (%d bytes)", digest, peer[-8:], len(data))
            return _store(cache, digest, data)
        if attempt + 1 < FETCH_ATTEMPTS:
            await asyncio.sleep(0.5 * 2**attempt)
    last = "; ".join(problems[-2:]) or "no peer to ask"
    raise TokenizerFetchError(
        f"no peer delivered the run's tokenizer (digest {digest}): {last}; pass the run's tokenizer.json "
        "with --tokenizer"
    )


def _store(cache: Path, digest: str, data: bytes) -> Path:
    path = cached_path(cache, digest)
    with file_lock(path):
        atomic_write(path, lambda handle: handle.write(data))
    load_tokenizer(path)  # a file of the right digest that is no tokenizer: the run's own fault, said at once
    return path


def _check_reply(meta: bytes, tensors: list[Tensor], run_id: str, digest: str) -> bytes:
    header = decode(meta)
    if isinstance(header, Error):
        raise TokenizerFetchError(f"refused ({header.code}: {header.reason})")
    if not isinstance(header, TokenizerTransfer) or header.run_id != run_id or header.digest != digest:
        raise TokenizerFetchError(f"answered a {type(header).__name__}, not tokenizer {digest}")
    data = unpack(tensors, header.size)
    got = digest_of(data)
    if got != digest:
        raise TokenizerFetchError(f"sent a file of digest {got}, not {digest}: rejected")
    return data


async def obtain_tokenizer(spec: RunSpec, given: Path | None, dht: SwarmDHT, cache: Path) -> Path | None:
    """The tokenizer.json a data node of the run uses: `given` (`--tokenizer`, checked against the run's
    digest when the corpus is loaded), else the cached file with the run's `digest`, else one fetched from
    the run's owners or its data nodes online. None when the run names no tokenizer (a definition from
    before digests): the node trains the default one, as the bootstrap did."""
    digest = spec.tokenizer_digest
    if given is not None or digest is None:
        return given
    found = find_cached(digest, [cached_path(cache, digest), *sorted(cache.glob("tokenizer-*.json"))])
    if found is not None:
        return found
    data_nodes = [
        record.peer_id
        for record in await dht.read_stage(0)
        if record.record.state == NodeState.ONLINE and record.peer_id != dht.peer_id
    ]
    transport = Transport(await dht.replicate_p2p(), FETCH_CONFIG)
    try:
        peers = [*sorted(dht.run_owners), *data_nodes]
        return await fetch_tokenizer(transport, spec.run_id, digest, peers, cache)
    finally:
        await transport.close()
