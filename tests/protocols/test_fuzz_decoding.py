"""Fuzzing what peers send before anything trusts it: the message decoder and the DHT record validator.

Whatever the bytes, `decode` returns a message of the protocol or raises RemoteProtocolError, and the record
validator answers True or False; neither raises anything else, and neither crashes the process (the deep
msgpack nesting that used to overflow the C stack is among the examples).
"""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from protocols.errors import RemoteProtocolError
from protocols.messages import KINDS, PROTOCOL_VERSION, Message, NodeRecord, NodeState, decode, encode
from swarmnode import msgpack_guard
from swarmnode.identity import Identity
from swarmnode.records import SwarmRecordValidator, run_key, stage_key, subkey_of

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.binary(max_size=40),
)
structures = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=40,
)
field_names = sorted({f.name for kind in KINDS.values() for f in dataclasses.fields(kind)})


def _tuple_bomb(depth: int) -> bytes:
    value = msgpack.packb([1])
    for _ in range(depth):
        value = msgpack.packb(msgpack.ExtType(0x40, value))
    return value


def _decodes_or_refuses(data: bytes) -> None:
    try:
        message = decode(data)
    except RemoteProtocolError:
        return
    assert isinstance(message, Message)
    assert decode(encode(message)) == message  # what is accepted is a well-formed message


@FUZZ
@given(st.binary(max_size=512))
@example(b"\x91" * 100_000 + b"\x01")  # arrays nested 100,000 deep
@example(_tuple_bomb(200))
def test_decode_takes_arbitrary_bytes(data: bytes) -> None:
    _decodes_or_refuses(data)


@FUZZ
@given(
    kind=st.sampled_from(sorted(KINDS)),
    version=st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION + 1, "1", None]),
    fields=st.dictionaries(st.sampled_from(field_names), structures, max_size=10),
)
def test_decode_takes_arbitrary_messages_of_every_kind(kind: str, version: object, fields: dict) -> None:
    """Maps that look like messages (a known kind, real field names) with values of any type and size."""
    _decodes_or_refuses(msgpack.packb({"v": version, "kind": kind, **fields}, use_bin_type=True))


@pytest.fixture(scope="module")
def validator() -> SwarmRecordValidator:
    msgpack_guard.install()
    return SwarmRecordValidator("fuzz", Identity.generate())


KEYS = [DHTID.generate(source=key).to_bytes() for key in (stage_key("fuzz", 1), run_key("fuzz"))]


@FUZZ
@given(
    key=st.sampled_from(KEYS),
    subkey=st.one_of(st.binary(max_size=80), structures.map(MSGPackSerializer.dumps)),
    value=st.one_of(st.binary(max_size=300), structures.map(MSGPackSerializer.dumps)),
    ahead=st.floats(min_value=-1e9, max_value=1e12, allow_nan=False),
)
@example(key=KEYS[0], subkey=_tuple_bomb(200), value=b"x" * 80, ahead=10.0)
@example(key=KEYS[1], subkey=MSGPackSerializer.dumps(b"x"), value=_tuple_bomb(200) + bytes(64), ahead=10.0)
def test_the_record_validator_answers_every_record(
    validator: SwarmRecordValidator, key: bytes, subkey: bytes, value: bytes, ahead: float
) -> None:
    record = DHTRecord(key, subkey, value, get_dht_time() + ahead)
    assert validator.validate(record) is False  # nothing random is signed by the peer it names


@FUZZ
@given(st.binary(min_size=1, max_size=120))
def test_a_signed_record_with_any_byte_changed_is_refused(noise: bytes) -> None:
    owner = Identity.generate()
    validator = SwarmRecordValidator("fuzz", owner)
    value = MSGPackSerializer.dumps(encode(NodeRecord(NodeState.ONLINE, 1, 5, 0)))
    record = DHTRecord(KEYS[0], MSGPackSerializer.dumps(subkey_of(owner.peer_id)), value, get_dht_time() + 30)
    signed = validator.sign_value(dataclasses.replace(record))
    assert validator.validate(dataclasses.replace(record, value=signed))
    position = noise[0] % len(signed)
    flipped = signed[:position] + bytes([signed[position] ^ (noise[-1] | 1)]) + signed[position + 1 :]
    assert not validator.validate(dataclasses.replace(record, value=flipped))
