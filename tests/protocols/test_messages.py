"""Wire schemas: round trips, and every kind of bad input rejected with RemoteProtocolError only."""

from __future__ import annotations

import math
from dataclasses import fields, replace

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.hops import Abort, Backward, Forward, Route
from protocols.links import MAX_LINK_COSTS, MAX_LINK_PEER_CHARS, MAX_LINK_SECONDS, LinkCost
from protocols.manifest import TensorSpec
from protocols.messages import (
    KINDS,
    MAX_ID,
    MAX_RECORD_BYTES,
    PROTOCOL_VERSION,
    Ack,
    AveragingReply,
    AveragingRequest,
    Decline,
    Error,
    ErrorCode,
    NodeRecord,
    NodeState,
    Pong,
    decode,
    encode,
)
from protocols.reach import ReachReply, ReachRequest
from protocols.standby import StandbyRecord
from protocols.transfers import StatePart, StateRequest, StateTransfer, TokenizerRequest, TokenizerTransfer

HIDDEN = TensorSpec("hidden", (4, 128, 64), "bfloat16")
PHI = (TensorSpec("layers.0.w", (64, 64), "float32"), TensorSpec("layers.0.b", (64,), "float32"))
THETA = tuple(replace(spec, dtype="float16") for spec in PHI)
PATH = ("12D3KooWA", "12D3KooWB", "12D3KooWC")

EXAMPLES = [
    Forward("run-1", 7, 3, PATH, 1, (0, 1, 2), (2, 1, 1), (HIDDEN, TensorSpec("positions", (128,), "int64"))),
    Backward("run-1", 7, 3, PATH, 2, (0, 1, 2), tensors=(HIDDEN,)),
    Abort("run-1", "12D3KooWA", 7, 3, "hop 2 timed out after 30 s"),
    StateRequest("run-1", 2, (StatePart.WEIGHTS, StatePart.OPTIMIZER)),
    StateTransfer("run-1", 1, (StatePart.WEIGHTS, StatePart.EMBEDDING_COPY), 1200, 24, 0.83, PHI),
    StateTransfer("run-1", 3, (StatePart.WEIGHTS,), 0, 0, None, ()),
    AveragingRequest("run-1", 2, 24, PHI, THETA),
    AveragingReply("run-1", 2, 24, True, "", PHI, THETA),
    AveragingReply("run-1", 2, 24, False, "not this node's partner", decline=Decline.NOT_PARTNER),
    Ack(),
    Pong(3),
    Error(ErrorCode.BUSY, "queue full"),
    NodeRecord(
        NodeState.ONLINE,
        0,
        1200,
        24,
        loss=3.25,
        throughput=12.5,
        queue_depth=2,
        addrs=("/ip4/127.0.0.1/tcp/1",),
    ),
    NodeRecord(
        NodeState.JOINING,
        4,
        0,
        0,
        grad_norm=1.7,
        copies=(StatePart.HEAD_COPY,),
        site="Belgium",
        links=(LinkCost("12D3KooWpeer", 0.25), LinkCost("12D3KooWother", 0.0)),
    ),
    StateTransfer("run-1", 2, (StatePart.WEIGHTS, StatePart.OPTIMIZER), 7, 1, 0.5, PHI, lr_factor=1.1),
    ReachRequest((31337, 4001)),
    ReachReply("203.0.113.7", (31337,)),
    StandbyRecord(taken=2, site="Belgium"),
    TokenizerRequest("run-1", "0123456789abcdef"),
    TokenizerTransfer("run-1", "0123456789abcdef", 2_500_000),
    Route("run-1", 7, 3, (*PATH, PATH[0]), 1),
    Forward("run-1", 7, 3, PATH, 1, (0, 1, 0), (1, 2, 1), nonce=9, cohort=PATH[::2], senders=(0, 3, 0)),
    Forward("run-1", 2**62 + 4, 3, PATH, 1, (0, 1, 0), evaluate=True, nonce=9, weights_of=100),
]
ROUTE = next(message for message in EXAMPLES if isinstance(message, Route))


def wire(message: object) -> dict:
    return msgpack.unpackb(encode(message), raw=False)


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message: object) -> None:
    data = encode(message)
    assert decode(data) == message
    assert decode(data, expected_type=type(message)) == message
    assert decode(bytearray(data)) == message


def test_every_kind_is_covered_and_versioned() -> None:
    assert {type(m) for m in EXAMPLES} == set(KINDS.values())
    assert all(wire(m)["v"] == PROTOCOL_VERSION and wire(m)["kind"] == m.KIND for m in EXAMPLES)


def test_records_fit_the_dht() -> None:
    biggest = NodeRecord(
        NodeState.RECOVERING,
        1024,
        2**63 - 1,
        2**63 - 1,
        -1.5,
        1e300,
        1e300,
        2**63 - 1,
        (StatePart.EMBEDDING_COPY, StatePart.HEAD_COPY),
        tuple("/ip4/127.0.0.1/tcp/1/p2p/" + "x" * 230 for _ in range(16)),
        site="s" * MAX_ID,
        links=tuple(LinkCost("p" * MAX_LINK_PEER_CHARS, MAX_LINK_SECONDS) for _ in range(MAX_LINK_COSTS)),
    )
    assert decode(encode(biggest), NodeRecord, max_bytes=MAX_RECORD_BYTES) == biggest


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_truncation_is_rejected(message: object) -> None:
    data = encode(message)
    for end in range(len(data)):
        with pytest.raises(RemoteProtocolError):
            decode(data[:end])


def test_trailing_bytes_are_rejected() -> None:
    with pytest.raises(RemoteProtocolError, match="trailing"):
        decode(encode(Ack()) + b"\x00")


def test_oversized_is_rejected() -> None:
    data = encode(EXAMPLES[0])
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        decode(data, max_bytes=len(data) - 1)
    with pytest.raises(RemoteProtocolError):
        decode(pack({"v": 1, "kind": "ack", "detail": "x" * 5000}))


def test_wrong_expected_type_is_rejected() -> None:
    with pytest.raises(RemoteProtocolError, match="expected a backward message, got forward"):
        decode(encode(EXAMPLES[0]), expected_type=Backward)


def test_wrong_version_is_rejected() -> None:
    body = wire(Ack())
    for other in (PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1):  # an older peer too: the meanings differ
        with pytest.raises(RemoteProtocolError, match=f"protocol version {other}, this node speaks"):
            decode(pack({**body, "v": other}))
    for bad in (None, "1", True, 1.0):
        with pytest.raises(RemoteProtocolError, match="version"):
            decode(pack({**body, "v": bad}))


def test_unknown_kind_is_rejected() -> None:
    with pytest.raises(RemoteProtocolError, match="unknown message kind 'gossip'"):
        decode(pack({"v": PROTOCOL_VERSION, "kind": "gossip"}))
    with pytest.raises(RemoteProtocolError, match="unknown"):
        decode(pack({"v": PROTOCOL_VERSION}))


@pytest.mark.parametrize(
    "payload",
    [
        [1, "ack", ""],
        "ack",
        None,
        {"v": 1, "kind": "pong"},  # missing field
        {"v": 1, "kind": "ack", "extra": 1},  # unexpected field
        {"v": 1, "kind": "pong", "stage": 1, 5: ""},  # non-string key
    ],
)
def test_malformed_structure_is_rejected(payload: object) -> None:
    with pytest.raises(RemoteProtocolError):
        decode(pack(payload))


def mutate(message: object, **changes: object) -> bytes:
    return pack({**wire(message), **changes})


FORWARD, TRANSFER, RECORD = EXAMPLES[0], EXAMPLES[4], EXAMPLES[12]


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (mutate(FORWARD, iteration="7"), "iteration: expected an int"),
        (mutate(FORWARD, iteration=-1), "iteration"),
        (mutate(FORWARD, iteration=True), "iteration"),
        (mutate(FORWARD, microbatch=2**64 - 1), "microbatch"),
        (mutate(FORWARD, hop=3), "past the end"),
        (mutate(FORWARD, path=[]), "path"),
        (mutate(FORWARD, path=["a", ""]), r"path\[1\]"),
        (mutate(FORWARD, run_id="run\n1"), "run_id"),
        (mutate(FORWARD, tensors={"name": "h"}), "tensors"),
        (mutate(FORWARD, tensors=[{"name": "h", "shape": [1] * 9, "dtype": "float32"}]), "shape"),
        (mutate(FORWARD, tensors=[{"name": "h", "shape": [2**16, 2**16], "dtype": "float32"}]), "elements"),
        (mutate(FORWARD, tensors=[{"name": "h", "shape": [-1], "dtype": "float32"}]), "shape"),
        (mutate(FORWARD, tensors=[{"name": "h", "shape": [2], "dtype": "object"}]), "dtype"),
        (mutate(FORWARD, tensors=[{"name": "h", "shape": [2]}]), r"tensors\[0\]"),
        (mutate(FORWARD, tensors=[{"name": "h", "shape": [2], "dtype": "bool"}] * 2), "repeated"),
        (mutate(RECORD, loss=math.nan), "loss: expected a finite number"),
        (mutate(RECORD, loss=math.inf), "loss"),
        (mutate(RECORD, grad_norm=-0.5), "grad_norm"),
        (mutate(RECORD, throughput=-1.0), "throughput"),
        (mutate(RECORD, queue_depth=-3), "queue_depth"),
        (mutate(RECORD, state="dead"), "state"),
        (mutate(RECORD, stage=5000), "stage"),
        (mutate(RECORD, copies=["weights"]), "copies"),
        (mutate(TRANSFER, grad_norm=math.nan), "grad_norm"),
        (mutate(TRANSFER, parts=[]), "parts"),
        (mutate(TRANSFER, parts=["weights", "weights"]), "repeated"),
        (mutate(EXAMPLES[6], theta=wire(EXAMPLES[6])["theta"][:1]), "same non-empty"),
        (mutate(EXAMPLES[8], phi=wire(EXAMPLES[6])["phi"]), "declining reply carries no tensors"),
        (mutate(EXAMPLES[11], code="teapot"), "code"),
        (mutate(ROUTE, hop=0), "hop"),  # the data node itself needs no notice
        (mutate(ROUTE, hop=3), "hop: 3 is not a stage node"),  # the last hop is the data node
        (mutate(ROUTE, path=[*PATH, "12D3KooWZ"]), "does not return"),
        (mutate(ROUTE, path=PATH[:1] * 2), "path"),
    ],
)
def test_bad_fields_are_rejected_with_a_reason(data: bytes, words: str) -> None:
    with pytest.raises(RemoteProtocolError, match=words):
        decode(data)


def test_nan_bytes_are_rejected() -> None:
    data = encode(replace(RECORD, loss=1.0))
    nan = msgpack.packb(math.nan)
    patched = data.replace(msgpack.packb(1.0), nan)
    assert patched != data
    with pytest.raises(RemoteProtocolError, match="loss"):
        decode(patched)


def test_local_construction_is_checked() -> None:
    with pytest.raises(LocalProtocolError, match="hop"):
        Forward("run", 0, 0, ("a",), 1, (0,))
    with pytest.raises(LocalProtocolError, match="stages"):
        Forward("run", 0, 0, ("a", "b"), 1, (0,))
    with pytest.raises(LocalProtocolError, match="visits"):
        Forward("run", 0, 0, ("a", "b"), 1, (0, 1), (1,))
    for cohort, senders in (
        (("b", "a"), (1, 3)),  # not sorted
        (("a", "a"), (1, 1)),  # a data node twice
        (("a",), (1,)),  # not one entry per hop
        (("a",), (1, 2)),  # a bit beyond the cohort
        (("a", "c"), (0, 2)),  # a hop of a's path that does not name a
    ):
        with pytest.raises(LocalProtocolError, match=r"cohort|senders"):
            Forward("run", 0, 0, ("a", "b"), 1, (0, 1), cohort=cohort, senders=senders)
    with pytest.raises(LocalProtocolError, match="weights_of"):  # a training microbatch changes the weights
        Forward("run", 0, 0, ("a", "b"), 1, (0, 1), weights_of=3)
    with pytest.raises(LocalProtocolError, match="weights_of"):
        Forward("run", 0, 0, ("a", "b"), 1, (0, 1), evaluate=True, weights_of=-1)
    with pytest.raises(LocalProtocolError, match="loss"):
        NodeRecord(NodeState.ONLINE, 1, 0, 0, loss=math.inf)
    for hostile in (0.0, 1e30, -1.1):  # a donor's lr factor must not blow up or freeze the receiver's weights
        with pytest.raises(LocalProtocolError, match="lr_factor"):
            StateTransfer("run", 1, ("weights",), 0, 0, None, (), lr_factor=hostile)
    with pytest.raises(LocalProtocolError, match="elements"):
        TensorSpec("x", (2**31, 2), "float32")
    with pytest.raises(LocalProtocolError, match="not a protocol message"):
        encode(HIDDEN)
    with pytest.raises(LocalProtocolError):
        decode(encode(Ack()), expected_type=TensorSpec)
    with pytest.raises(LocalProtocolError, match="exceeds"):
        encode(
            StateTransfer(
                "run",
                1,
                ("weights",),
                0,
                0,
                None,
                [TensorSpec(f"{i:0200d}", (1,), "bool") for i in range(9000)],
            )
        )


def test_enums_and_lists_are_normalised() -> None:
    record = NodeRecord("online", 1, 0, 0, throughput=3, copies=["embedding_copy"], addrs=["/ip4/1.2.3.4"])
    assert (
        record.state is NodeState.ONLINE and record.throughput == 3.0 and isinstance(record.throughput, float)
    )
    assert record.copies == (StatePart.EMBEDDING_COPY,) and record.addrs == ("/ip4/1.2.3.4",)


# ---- fuzz ---------------------------------------------------------------------------------------------

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def only_remote_errors(data: bytes) -> None:
    try:
        decode(data)
    except RemoteProtocolError as exc:
        assert exc.reason


@FUZZ
@given(st.binary(max_size=256))
def test_random_bytes_only_raise_remote_errors(data: bytes) -> None:
    only_remote_errors(data)


@FUZZ
@given(st.sampled_from([encode(m) for m in EXAMPLES]), st.data())
def test_mutated_messages_only_raise_remote_errors(data: bytes, draw: st.DataObject) -> None:
    position = draw.draw(st.integers(0, len(data) - 1))
    replacement = draw.draw(st.binary(min_size=0, max_size=4))
    only_remote_errors(data[:position] + replacement + data[position + 1 :])


values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["name", "shape", "dtype", "x"]), inner, max_size=4)
    ),
    max_leaves=12,
)


@FUZZ
@given(st.sampled_from(sorted(KINDS)), st.data())
def test_well_formed_maps_with_random_values_only_raise_remote_errors(kind: str, draw: st.DataObject) -> None:
    names = [f.name for f in fields(KINDS[kind])]
    body = {name: draw.draw(values, label=name) for name in names}
    only_remote_errors(pack({"v": PROTOCOL_VERSION, "kind": kind, **body}))


def test_a_declining_averaging_reply_says_why_and_an_accepting_one_does_not() -> None:
    with pytest.raises(LocalProtocolError, match="decline"):
        AveragingReply("run-1", 2, 24, False, "no reason given")
    with pytest.raises(LocalProtocolError, match="decline"):
        AveragingReply("run-1", 2, 24, True, "", PHI, THETA, decline=Decline.FINISHED)
    reply = decode(encode(AveragingReply("r", 1, 2, False, "later", decline=Decline.NOT_REACHED)))
    assert reply.decline is Decline.NOT_REACHED
    body = wire(AveragingReply("r", 1, 2, False, "x", decline=Decline.FINISHED))
    body["decline"] = "because"
    with pytest.raises(RemoteProtocolError):
        decode(msgpack.packb(body))


PONG, DECLINED = EXAMPLES[10], EXAMPLES[8]


@pytest.mark.parametrize("stage", [-1, 1025, 2**64 - 1, True, 1.0, "1", None, [1], {"stage": 1}])
def test_a_hostile_pong_is_refused(stage: object) -> None:
    """A ping's answer names the stage served as an int in range (it once hid in free text)."""
    with pytest.raises(RemoteProtocolError, match="stage"):
        decode(mutate(PONG, stage=stage), Pong)


@pytest.mark.parametrize(
    "changes",
    [
        {"decline": "because"},
        {"decline": "NOT_REACHED"},  # the member's name, not its wire value
        {"decline": 1},
        {"decline": ["not_reached"]},
        {"decline": None},  # declining without a reason
        {"accept": True},  # accepting with a reason to decline (and no tensors)
    ],
)
def test_a_hostile_decline_is_refused(changes: dict[str, object]) -> None:
    with pytest.raises(RemoteProtocolError, match=r"decline|phi"):
        decode(mutate(DECLINED, **changes), AveragingReply)


@pytest.mark.parametrize("reason", list(Decline))
def test_every_decline_reason_arrives_as_the_enum(reason: Decline) -> None:
    """The averaging initiator retries on `Decline.NOT_REACHED` by identity, so the decoded reason is the
    enum member itself, never a string that merely compares equal."""
    reply = decode(encode(replace(DECLINED, decline=reason)), AveragingReply)
    assert reply.decline is reason


def test_a_forward_names_whose_work_the_plan_sends_through_its_hop() -> None:
    forward = Forward(
        "run", 4, 0, ("d", "x", "y", "d"), 1, (0, 1, 2, 0), cohort=("d", "e"), senders=(0, 3, 1, 0)
    )
    assert forward.senders_here() == {"d", "e"}
    assert replace(forward, hop=2).senders_here() == {"d"}
    assert replace(forward, senders=(0, 0, 1, 0)).senders_here() is None  # a re-routed hop: not known
    assert replace(forward, cohort=(), senders=()).senders_here() is None  # an older sender's forward
