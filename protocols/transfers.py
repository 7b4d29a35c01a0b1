"""State and tokenizer transfers' messages, sans-I/O: a node asks a live one for parts of a stage's state
(a joining node, a CheckFree rebuild) or for the run's tokenizer.json, and the answer's header says what
follows. The payload travels beside the header as tensors, in manifest order."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

from protocols._message import RUN, STAGE, Message
from protocols._schema import checked, choice, count, items, number, optional, text
from protocols.manifest import TensorSpec, manifest_field

MIN_LR_FACTOR, MAX_LR_FACTOR = 0.1, 10.0  # a learning-rate multiplier outside these corrupts weights
MAX_TOKENIZER_BYTES = 64 << 20  # a tokenizer.json (large vocabularies' files are tens of MB)


class StatePart(StrEnum):
    """Parts of a node's state that a state transfer can carry."""

    WEIGHTS = "weights"
    OPTIMIZER = "optimizer"
    EMBEDDING_COPY = "embedding_copy"  # stage 1's copy of E
    HEAD_COPY = "head_copy"  # stage s's copy of E'
    FIRST_STAGE_COPY = "first_stage_copy"  # stage 2's copy of stage 1's weights
    LAST_STAGE_COPY = "last_stage_copy"  # stage s-1's copy of stage s's weights


COPIES = frozenset(
    {StatePart.EMBEDDING_COPY, StatePart.HEAD_COPY, StatePart.FIRST_STAGE_COPY, StatePart.LAST_STAGE_COPY}
)
EDGE_COPIES = frozenset({StatePart.FIRST_STAGE_COPY, StatePart.LAST_STAGE_COPY})


_PARTS = items(choice(StatePart), len(StatePart), 1, unique=True)


@dataclass(frozen=True)
class StateRequest(Message):
    """Ask a live node of `stage` for parts of its state (a joining node or a CheckFree rebuild)."""

    KIND: ClassVar[str] = "state_request"
    run_id: str = field(metadata=checked(RUN))
    stage: int = field(metadata=checked(STAGE))
    parts: tuple[StatePart, ...] = field(metadata=checked(_PARTS))


@dataclass(frozen=True)
class StateTransfer(Message):
    """Header of a state transfer; `tensors` lists what follows. `grad_norm` is measured before clipping;
    `lr_factor` is the donor's learning-rate multiplier (x1.1 after a CheckFree rebuild), which a replica
    copying the donor takes over."""

    KIND: ClassVar[str] = "state_transfer"
    run_id: str = field(metadata=checked(RUN))
    stage: int = field(metadata=checked(STAGE))
    parts: tuple[StatePart, ...] = field(metadata=checked(_PARTS))
    step: int = field(metadata=checked(count()))
    outer_step: int = field(metadata=checked(count()))
    grad_norm: float | None = field(metadata=checked(optional(number(0.0))))
    tensors: tuple[TensorSpec, ...] = field(default=(), metadata=checked(manifest_field))
    lr_factor: float = field(default=1.0, metadata=checked(number(MIN_LR_FACTOR, MAX_LR_FACTOR)))


@dataclass(frozen=True)
class TokenizerRequest(Message):
    """Ask a node of the run for its tokenizer.json whose digest (`tokenizer.file_digest`) is `digest`."""

    KIND: ClassVar[str] = "tokenizer_request"
    run_id: str = field(metadata=checked(RUN))
    digest: str = field(metadata=checked(text(64, 16)))


@dataclass(frozen=True)
class TokenizerTransfer(Message):
    """The answer: the file's `size` bytes follow as one uint8 tensor; the asker checks their digest."""

    KIND: ClassVar[str] = "tokenizer_transfer"
    run_id: str = field(metadata=checked(RUN))
    digest: str = field(metadata=checked(text(64, 16)))
    size: int = field(metadata=checked(count(MAX_TOKENIZER_BYTES, 1)))
