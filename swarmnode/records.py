"""The swarm's shared state on the hivemind DHT: node records and the run definition.

Every node republishes a `protocols.messages.NodeRecord` under `{run}.stage.{k}` with its peer id plus its
RSA public key as the subkey, so hivemind's `RSASignatureValidator` lets only the owner write it. A second
validator checks that every value under this run's keys decodes as the right schema, so a hostile peer can
neither overwrite another node's record nor plant garbage that crashes readers. A node that stops
refreshing vanishes when its record expires; there is no delete.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer

from protocols.errors import ProtocolError
from protocols.messages import MAX_RECORD_BYTES, NodeRecord, decode
from swarmnode.runspec import RunSpec, RunSpecError

logger = logging.getLogger(__name__)

MAX_STAGES = 256
OWNER_MARKER = b"[owner:"


def stage_key(run_id: str, stage: int) -> str:
    return f"{run_id}.stage.{stage}"


def run_key(run_id: str) -> str:
    return f"{run_id}.run"


def owned_subkey(peer_id: str, validator: RSASignatureValidator) -> bytes:
    """The subkey of this node's record: its peer id, then its public key (which protects the record)."""
    return peer_id.encode() + validator.local_public_key


def peer_of_subkey(subkey: object) -> str | None:
    """The peer id in a record subkey, or None if the subkey is not an owned one with a valid peer id."""
    if not isinstance(subkey, bytes) or OWNER_MARKER not in subkey:
        return None
    peer = subkey.split(OWNER_MARKER, 1)[0]
    try:
        text = peer.decode("ascii")
        PeerID.from_base58(text)
    except (UnicodeDecodeError, ValueError):
        return None
    return text


def decode_record(value: object) -> NodeRecord:
    """A node record from a DHT value; raises ProtocolError for anything else."""
    if not isinstance(value, bytes):
        raise ProtocolError(f"a node record must be bytes, got {type(value).__name__}")
    return decode(value, NodeRecord, max_bytes=MAX_RECORD_BYTES)


def decode_run(value: object) -> RunSpec:
    """A run definition from a DHT value; raises RunSpecError for anything else."""
    if not isinstance(value, bytes) or len(value) > MAX_RECORD_BYTES:
        raise RunSpecError("a run definition must be bytes within the record size limit")
    try:
        raw = MSGPackSerializer.loads(value)
    except Exception as error:
        raise RunSpecError(f"run definition does not decode: {error}") from None
    return RunSpec.from_dict(raw)


class SwarmRecordValidator(RecordValidatorBase):
    """Rejects values under this run's keys that do not decode as their schema, or are not owner-signed."""

    def __init__(self, run_id: str) -> None:
        self._stage_keys = {
            DHTID.generate(source=stage_key(run_id, k)).to_bytes() for k in range(MAX_STAGES + 1)
        }
        self._run_key = DHTID.generate(source=run_key(run_id)).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self._stage_keys and record.key != self._run_key:
            return True
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            value = MSGPackSerializer.loads(record.value)
            if peer_of_subkey(subkey) is None:
                raise ProtocolError("subkey carries no owner key")
            if record.key == self._run_key:
                decode_run(value)
            else:
                decode_record(value)
        except (ProtocolError, RunSpecError, ValueError, TypeError) as error:
            logger.warning("rejected DHT record: %s", getattr(error, "reason", error))
            return False
        return True

    @property
    def priority(self) -> int:
        return 0  # after the signature validator has checked and stripped the signature

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


def make_validators(run_id: str) -> tuple[RSASignatureValidator, SwarmRecordValidator]:
    return RSASignatureValidator(), SwarmRecordValidator(run_id)


@dataclass(frozen=True)
class PeerRecord:
    """One node as seen on the DHT."""

    peer_id: str
    record: NodeRecord
    expires_at: float


def parse_stage_entries(entries: Iterable[tuple[object, object, float]]) -> list[PeerRecord]:
    """Node records from `(subkey, value, expiration)` triples, skipping (and logging) invalid ones."""
    peers = []
    for subkey, value, expiration in entries:
        peer_id = peer_of_subkey(subkey)
        try:
            if peer_id is None:
                raise ProtocolError("subkey carries no owner key")
            peers.append(PeerRecord(peer_id, decode_record(value), expiration))
        except ProtocolError as error:
            logger.warning("skipping a DHT record: %s", error.reason)
    return sorted(peers, key=lambda p: p.peer_id)
