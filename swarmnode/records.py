"""The swarm's shared state on the hivemind DHT: node records and the run definition, signed by their owners.

Every node republishes a `protocols.messages.NodeRecord` under `{run}.stage.{k}`, with its peer id as the
subkey, and signs it with its libp2p identity key (`swarmnode.identity`): the signature covers the key, the
subkey, the value and the expiry, and is checked against the key the peer id itself carries. So only the
owner of a peer id can speak in its name, and an expiry cannot be stretched. `SwarmRecordValidator` runs in
every DHT node on every store and on every value a lookup returns: it rejects values under this run's keys
that are unsigned, signed by another key, expire more than `MAX_EXPIRY_S` ahead, or do not decode as their
schema. A node that stops refreshing vanishes when its record expires; there is no delete.

The run definition is a record under `{run}.run`; anyone may store one, so readers take it only from the
run's owner (`SwarmDHT.read_run`). Standby nodes (`join --standby`) publish a
`protocols.standby.StandbyRecord` under `{run}.standby`, signed and checked the same way
(`swarmnode.standbys`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

from protocols.errors import ProtocolError
from protocols.messages import MAX_RECORD_BYTES, NodeRecord, decode
from protocols.standby import StandbyRecord
from swarmnode.identity import SIGNATURE_BYTES, Identity, verify
from swarmnode.peer_record import PeerRecord
from swarmnode.runspec import RunSpec, RunSpecError, RunVersionMismatch

logger = logging.getLogger(__name__)

MAX_STAGES = 256
MAX_EXPIRY_S = 600.0  # a record may not expire further ahead than this (node records live seconds)
_SIGNED = b"swarmnode-record-v1"  # domain separation: these signatures mean nothing elsewhere


def stage_key(run_id: str, stage: int) -> str:
    return f"{run_id}.stage.{stage}"


def run_key(run_id: str) -> str:
    return f"{run_id}.run"


def standby_key(run_id: str) -> str:
    return f"{run_id}.standby"


def subkey_of(peer_id: str) -> bytes:
    """The subkey a node stores its records under: its peer id."""
    return peer_id.encode()


def peer_of_subkey(subkey: object) -> str | None:
    """The peer id a record subkey names, or None if it names none."""
    if not isinstance(subkey, bytes) or len(subkey) > 128:
        return None
    try:
        text = subkey.decode("ascii")
    except UnicodeDecodeError:
        return None
    return text if _is_peer_id(text) else None


@functools.lru_cache(maxsize=4096)
def _is_peer_id(text: str) -> bool:
    try:
        PeerID.from_base58(text)
    except ValueError:
        return False
    return True


def signed_bytes(key: bytes, subkey: bytes, value: bytes, expiration_time: float) -> bytes:
    """What a record's signature covers (the DHT key id, the serialized subkey, the value, the expiry)."""
    return MSGPackSerializer.dumps([_SIGNED, key, subkey, value, expiration_time])


@functools.lru_cache(maxsize=8192)
def _verified(peer: str, signed: bytes, signature: bytes) -> bool:
    """`identity.verify`, remembered: a lookup gets the same record from several DHT peers, and a node may
    check a record on store and again on read."""
    return verify(peer, signed, signature)


def decode_record(value: object) -> NodeRecord:
    """A node record from a DHT value; raises ProtocolError for anything else."""
    if not isinstance(value, bytes):
        raise ProtocolError(f"a node record must be bytes, got {type(value).__name__}")
    return decode(value, NodeRecord, max_bytes=MAX_RECORD_BYTES)


def decode_standby(value: object) -> StandbyRecord:
    """A standby record from a DHT value; raises ProtocolError for anything else."""
    if not isinstance(value, bytes):
        raise ProtocolError(f"a standby record must be bytes, got {type(value).__name__}")
    return decode(value, StandbyRecord, max_bytes=MAX_RECORD_BYTES)


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
    """Signs this node's records under this run's keys, and admits a value under those keys only if its
    owner signed it, it expires within `MAX_EXPIRY_S`, and it decodes as its schema. Other keys pass."""

    def __init__(self, run_id: str, identity: Identity) -> None:
        self._stage_keys = {
            DHTID.generate(source=stage_key(run_id, k)).to_bytes() for k in range(MAX_STAGES + 1)
        }
        self._run_key = DHTID.generate(source=run_key(run_id)).to_bytes()
        self._standby_key = DHTID.generate(source=standby_key(run_id)).to_bytes()
        self._identity = identity
        self._own_subkey = MSGPackSerializer.dumps(subkey_of(identity.peer_id))

    def _ours(self, record: DHTRecord) -> bool:
        return record.key in self._stage_keys or record.key in (self._run_key, self._standby_key)

    def validate(self, record: DHTRecord) -> bool:
        if not self._ours(record):
            return True
        try:
            self._check(record)
        except (ProtocolError, RunSpecError, ValueError, TypeError) as error:
            reason = str(getattr(error, "reason", error))[:200]
            logger.warning("rejected DHT record: %s", reason)
            return False
        return True

    def _check(self, record: DHTRecord) -> None:
        if record.expiration_time > get_dht_time() + MAX_EXPIRY_S:
            raise ProtocolError(f"expires more than {MAX_EXPIRY_S:.0f} s ahead")
        peer = peer_of_subkey(MSGPackSerializer.loads(record.subkey))
        if peer is None:
            raise ProtocolError("the subkey names no peer")
        if len(record.value) <= SIGNATURE_BYTES:
            raise ProtocolError("unsigned")
        payload, signature = record.value[:-SIGNATURE_BYTES], record.value[-SIGNATURE_BYTES:]
        if not _verified(
            peer, signed_bytes(record.key, record.subkey, payload, record.expiration_time), signature
        ):
            raise ProtocolError(f"not signed by {peer[-8:]}, the peer it names")
        value = MSGPackSerializer.loads(payload)
        if record.key == self._run_key:
            # signed by its owner: kept even if of another version, so a joiner learns why it cannot join
            with contextlib.suppress(RunVersionMismatch):
                decode_run(value)
        elif record.key == self._standby_key:
            decode_standby(value)
        else:
            decode_record(value)

    def sign_value(self, record: DHTRecord) -> bytes:
        if not self._ours(record) or record.subkey != self._own_subkey:
            return record.value
        data = signed_bytes(record.key, record.subkey, record.value, record.expiration_time)
        return record.value + self._identity.sign(data)

    def strip_value(self, record: DHTRecord) -> bytes:
        if not self._ours(record) or len(record.value) <= SIGNATURE_BYTES:
            return record.value
        return record.value[:-SIGNATURE_BYTES]

    @property
    def priority(self) -> int:
        return 10

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


def parse_stage_entries(entries: Iterable[tuple[object, object, float]]) -> list[PeerRecord]:
    """Node records from `(subkey, value, expiration)` triples, skipping (and logging) invalid ones."""
    peers = []
    for subkey, value, expiration in entries:
        peer_id = peer_of_subkey(subkey)
        try:
            if peer_id is None:
                raise ProtocolError("the subkey names no peer")
            peers.append(PeerRecord(peer_id, decode_record(value), expiration))
        except ProtocolError as error:
            logger.warning("skipping a DHT record: %s", error.reason)
    return sorted(peers, key=lambda p: p.peer_id)
