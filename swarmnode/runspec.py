"""The run definition: everything a daemon needs to join a run, published by the bootstrap peer.

`swarmnode join --stage K --initial-peers ADDR` reads it from the DHT, so a volunteer passes nothing else.
It is small (well under the DHT's value limit) and checked field by field when read from the wire.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from protocols._schema import (
    Schema,
    checked,
    count,
    flag,
    number,
    one_of,
    optional,
    show,
    text,
)
from protocols.errors import LocalProtocolError
from protocols.messages import PROTOCOL_VERSION
from swarmnode import __version__
from swarmnode.presets import get_preset
from swarmnode.source_spec import DataSource, SourceSpecError

COMPRESSIONS = ("none", "float16")
_SHA256 = re.compile(r"[0-9a-f]{64}")
COMPUTE_DTYPE_NAMES = ("float32", "bfloat16", "float16")  # `precision.COMPUTE_DTYPES`, torch-free
# how data nodes choose a run's paths (`node.planning`): SkipPipe's scheduler, or the paper's baseline of
# random skips in stage order, blind to collisions (for benchmarks: `benchmarks/wan_swarm.py`)
PLANNERS = ("skippipe", "random_skips")


class RunSpecError(ValueError):
    """A run definition (file, flags or DHT value) that is missing fields, mistyped or inconsistent."""


class RunVersionMismatch(RunSpecError):
    """A run definition made by a swarmnode this one cannot join (another wire protocol, or fields it does
    not know): the message names both versions and what to install."""


COUNT_LIMIT = 10**9  # of any size or count
SEED_LIMIT = 2**63 - 1  # what msgpack carries
MAX_PATH_CHARS = 4096  # `data`: a path as given
MAX_LABEL_CHARS = 64  # run id, preset, versions, a tokenizer digest
MAX_STAGES = 1024  # `init_digests` holds at most this many stages' digests


def _above_zero(value: Any, name: str) -> float:
    """A finite number greater than 0."""
    try:
        result = number(0.0)(value, name)
    except LocalProtocolError:
        result = 0.0
    if result == 0.0:
        raise LocalProtocolError(f"{name}: expected a finite number > 0, got {show(value)}")
    return result


def _fraction(value: Any, name: str) -> float:
    """A finite number in [0, 1)."""
    try:
        result = number(0.0, 1.0)(value, name)
    except LocalProtocolError:
        result = 1.0
    if result == 1.0:
        raise LocalProtocolError(f"{name}: expected a finite number in [0, 1), got {show(value)}")
    return result


def _source(value: Any, name: str) -> DataSource:
    """A `DataSource`, or the map it is written as."""
    try:
        return value if isinstance(value, DataSource) else DataSource.from_dict(value)
    except SourceSpecError as error:
        raise LocalProtocolError(f"{name}: {error}") from None


POSITIVE = checked(count(COUNT_LIMIT, minimum=1))
ABOVE_ZERO = checked(_above_zero)


@dataclass(frozen=True)
class RunSpec(Schema):
    """One training run. `stages` counts transformer stages; stage ids run from 0 (data stage) to `stages`.

    Every field converts and checks itself (`protocols._schema`); `_check` adds the rules across fields.
    Any of them broken is a one-line RunSpecError naming the field."""

    run_id: str = field(default="swarm", metadata=checked(text(MAX_LABEL_CHARS, minimum=1)))
    preset: str = field(default="tiny", metadata=checked(text(MAX_LABEL_CHARS, minimum=1)))
    stages: int = field(default=3, metadata=POSITIVE)
    # `--data` as given (None: the default corpus); `data_source` describes it
    data: str | None = field(default=None, metadata=checked(optional(text(MAX_PATH_CHARS))))
    vocab_size: int = field(default=4096, metadata=POSITIVE)
    seed: int = field(default=0, metadata=checked(count(SEED_LIMIT, minimum=-SEED_LIMIT - 1)))
    # per data node, iteration and pipeline (`planning.pipeline_width`)
    microbatches: int = field(default=4, metadata=POSITIVE)
    # the most pipelines a data node feeds: its work per step grows with them, and online records cost
    # nothing to forge
    max_pipelines: int = field(default=4, metadata=POSITIVE)
    batch_size: int = field(default=8, metadata=POSITIVE)
    seq_len: int = field(default=128, metadata=POSITIVE)
    lr: float = field(default=3e-3, metadata=ABOVE_ZERO)
    warmup_steps: int = field(default=20, metadata=checked(count(COUNT_LIMIT)))
    total_steps: int = field(default=1000, metadata=POSITIVE)
    max_grad_norm: float = field(default=1.0, metadata=ABOVE_ZERO)
    skip_ratio: float = field(default=0.0, metadata=checked(_fraction))
    planner: str = field(default="skippipe", metadata=checked(one_of(frozenset(PLANNERS))))
    # a fresh swarm trains once this many data nodes are online (they start together)
    min_data_nodes: int = field(default=1, metadata=POSITIVE)
    # ... and this many nodes of every transformer stage (the run's pipelines from its first step)
    min_replicas: int = field(default=1, metadata=POSITIVE)
    node_memory: int = field(default=4, metadata=POSITIVE)
    checkfree_plus: bool = field(default=True, metadata=checked(flag))
    # CheckFree+'s copies of the edge stages (stage 1's weights kept by stage 2, stage s's by stage s-1),
    # which rebuild a lost edge stage from its own weights (`protocols.checkfree.Method.EDGE_COPY`)
    edge_copies: bool = field(default=True, metadata=checked(flag))
    # the paper's CheckFree+ edge-stage swaps (`protocols.checkfree.swaps_edge_pairs`): off by default, as
    # they cost 2-10% of validation loss when no edge stage is lost and the edge copies rebuild better
    edge_swaps: bool = field(default=False, metadata=checked(flag))
    noloco_inner_steps: int = field(default=50, metadata=POSITIVE)
    noloco_alpha: float = field(default=0.5, metadata=checked(number()))
    noloco_beta: float = field(default=0.7, metadata=checked(number()))
    noloco_gamma: float = field(default=0.7, metadata=checked(number()))
    copy_refresh_steps: int = field(default=10, metadata=POSITIVE)
    compression: str = field(default="none", metadata=checked(one_of(frozenset(COMPRESSIONS))))
    # the run's default compute dtype, and how activations travel (`precision`)
    dtype: str = field(default="float32", metadata=checked(one_of(frozenset(COMPUTE_DTYPE_NAMES))))
    # started from weights: stage 0..s's SHA-256, comma separated (`seed`)
    init_digests: str | None = field(default=None, metadata=checked(optional(text(65 * MAX_STAGES))))
    # the run's tokenizer.json (`tokenizer.file_digest`): data nodes match it
    tokenizer_digest: str | None = field(default=None, metadata=checked(optional(text(MAX_LABEL_CHARS))))
    # None (definitions from before it): what `data` names
    data_source: DataSource | None = field(default=None, metadata=checked(optional(_source)))
    # of the bootstrap that published the run
    swarmnode_version: str = field(default=__version__, metadata=checked(text(MAX_LABEL_CHARS)))
    # the wire protocol (`protocols.messages`) every node must speak
    protocol_version: int = field(default=PROTOCOL_VERSION, metadata=checked(count(COUNT_LIMIT)))
    hop_timeout_s: float = field(default=10.0, metadata=ABOVE_ZERO)
    iteration_timeout_s: float = field(default=30.0, metadata=ABOVE_ZERO)
    record_period_s: float = field(default=1.0, metadata=ABOVE_ZERO)
    record_ttl_s: float = field(default=4.0, metadata=ABOVE_ZERO)

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except LocalProtocolError as error:
            name, _, why = error.reason.partition(": ")
            raise RunSpecError(f"run field {name!r}: {why}") from None

    def _check(self) -> None:
        if "." in self.run_id:
            raise RunSpecError(f"run id {self.run_id!r} must be 1-64 characters without '.'")
        if self.data_source is not None:
            try:
                named = DataSource.parse(self.data, self.data_source.text_column).locator()
            except SourceSpecError as error:
                raise RunSpecError(f"run field 'data': {error}") from None
            if named != self.data_source.locator():
                raise RunSpecError(f"run field 'data_source' ({self.data_source}) is not what 'data' names")
        try:
            preset = get_preset(self.preset)
        except ValueError as error:
            raise RunSpecError(str(error)) from None
        if preset.model.n_layers % self.stages:
            raise RunSpecError(
                f"{preset.model.n_layers} layers of preset {self.preset!r} "
                f"do not divide into {self.stages} stages"
            )
        if self.seq_len > preset.model.max_seq_len:
            raise RunSpecError(
                f"seq_len {self.seq_len} exceeds the preset's context {preset.model.max_seq_len}"
            )
        if self.init_digests is not None:
            digests = self.init_digests.split(",")
            if len(digests) != self.stages + 1 or not all(_SHA256.fullmatch(d) for d in digests):
                raise RunSpecError(
                    f"init_digests must be {self.stages + 1} SHA-256 hex digests (stages 0..{self.stages}), "
                    "comma separated"
                )
        if self.planner == "random_skips" and self.skip_ratio == 0:
            raise RunSpecError("planner 'random_skips' picks the stages to skip: give a skip_ratio above 0")
        if self.record_ttl_s <= self.record_period_s:
            raise RunSpecError("record_ttl_s must exceed record_period_s")

    @classmethod
    def for_preset(cls, preset_name: str, **overrides: Any) -> RunSpec:
        """A run with the preset's training defaults, then `overrides` (None values are ignored)."""
        preset = get_preset(preset_name)
        base = cls(
            preset=preset_name,
            stages=preset.n_stages,
            vocab_size=preset.vocab_size,
            microbatches=preset.microbatches,
            batch_size=preset.batch_size,
            seq_len=preset.seq_len,
            lr=preset.lr,
            warmup_steps=preset.warmup_steps,
            noloco_inner_steps=preset.noloco_inner_steps,
        )
        return base.with_overrides(**overrides)

    @property
    def source(self) -> DataSource:
        """The run's data source: `data_source`, or (an older definition) what `data` names."""
        return self.data_source or DataSource.parse(self.data)

    def with_data(self, data: str | None, text_column: str | None = None) -> RunSpec:
        """This run reading `data` (`--data`; None: the run's) from `text_column` (None: the run's), its
        `data_source` described (SourceSpecError for a bad pair)."""
        column = text_column if text_column is not None else self.source.text_column
        named = self.data if data is None else data
        described = DataSource.parse(named, None if named is None and text_column is None else column)
        return replace(self, data=named, data_source=described)

    def with_fingerprint(self, fingerprint: str) -> RunSpec:
        """This run with the bootstrap's fingerprint of its data (`DataSource.fingerprint`)."""
        return replace(self, data_source=replace(self.source, fingerprint=fingerprint))

    def init_digest(self, stage: int) -> str | None:
        """The digest of `stage`'s initial weights, if the run starts from weights."""
        return None if self.init_digests is None else self.init_digests.split(",")[stage]

    def with_overrides(self, **overrides: Any) -> RunSpec:
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: object) -> RunSpec:
        """Parse a run definition from JSON or the DHT; unknown or mistyped fields raise RunSpecError."""
        if not isinstance(raw, dict):
            raise RunSpecError(f"a run definition must be a mapping, got {type(raw).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(map(str, raw)) - set(known))
        theirs = raw.get("protocol_version", PROTOCOL_VERSION)
        if theirs != PROTOCOL_VERSION or (
            unknown and raw.get("swarmnode_version", __version__) != __version__
        ):
            version = raw.get("swarmnode_version")
            made_by = f"swarmnode {version}" if isinstance(version, str) else "another swarmnode"
            install = f"pip install 'swarmnode=={version}'" if isinstance(version, str) else "its version"
            raise RunVersionMismatch(
                f"the run was defined by {made_by} (wire protocol {theirs}); this is swarmnode {__version__} "
                f"(wire protocol {PROTOCOL_VERSION}): install the run's version ({install}) to join it"
            )
        if unknown:
            raise RunSpecError(
                f"unknown run field(s): {', '.join(unknown)}; the fields are {', '.join(known)}"
            )
        try:
            return cls(**raw)
        except (KeyError, TypeError) as error:
            raise RunSpecError(f"invalid run definition: {error}") from None

    @classmethod
    def from_file(cls, path: Path) -> RunSpec:
        try:
            raw = json.loads(path.read_text())
        except OSError as error:
            raise RunSpecError(f"cannot read run file {path}: {error.strerror}") from None
        except json.JSONDecodeError as error:
            raise RunSpecError(f"run file {path} is not valid JSON: {error}") from None
        if isinstance(raw, dict) and "preset" in raw:
            preset_name = raw["preset"]
            try:
                base = cls.for_preset(preset_name) if isinstance(preset_name, str) else cls
            except (KeyError, ValueError) as error:
                raise RunSpecError(f"run file {path}: {error}") from None
            if isinstance(base, RunSpec):
                raw = {**base.to_dict(), **raw}
        return cls.from_dict(raw)
