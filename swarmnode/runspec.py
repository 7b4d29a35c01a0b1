"""The run definition: everything a daemon needs to join a run, published by the bootstrap peer.

`swarmnode join --stage K --initial-peers ADDR` reads it from the DHT, so a volunteer passes nothing else.
It is small (well under the DHT's value limit) and checked field by field when read from the wire.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from protocols.messages import PROTOCOL_VERSION
from swarmnode import __version__
from swarmnode.presets import get_preset
from swarmnode.source_spec import DataSource, SourceSpecError

COMPRESSIONS = ("none", "float16")
_SHA256 = re.compile(r"[0-9a-f]{64}")
COMPUTE_DTYPE_NAMES = ("float32", "bfloat16", "float16")  # `precision.COMPUTE_DTYPES`, torch-free


class RunSpecError(ValueError):
    """A run definition (file, flags or DHT value) that is missing fields, mistyped or inconsistent."""


class RunVersionMismatch(RunSpecError):
    """A run definition made by a swarmnode this one cannot join (another wire protocol, or fields it does
    not know): the message names both versions and what to install."""


@dataclass(frozen=True)
class RunSpec:
    """One training run. `stages` counts transformer stages; stage ids run from 0 (data stage) to `stages`."""

    run_id: str = "swarm"
    preset: str = "tiny"
    stages: int = 3
    data: str | None = None  # `--data` as given (None: the default corpus); `data_source` describes it
    vocab_size: int = 4096
    seed: int = 0
    microbatches: int = 4
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 20
    total_steps: int = 1000
    max_grad_norm: float = 1.0
    skip_ratio: float = 0.0
    min_data_nodes: int = 1  # a fresh swarm trains once this many data nodes are online (they start together)
    node_memory: int = 4
    checkfree_plus: bool = True
    noloco_inner_steps: int = 50
    noloco_alpha: float = 0.5
    noloco_beta: float = 0.7
    noloco_gamma: float = 0.7
    copy_refresh_steps: int = 10
    compression: str = "none"
    dtype: str = "float32"  # the run's default compute dtype, and how activations travel (`precision`)
    init_digests: str | None = None  # started from weights: stage 0..s's SHA-256, comma separated (`seed`)
    tokenizer_digest: str | None = (
        None  # the run's tokenizer.json (`tokenizer.file_digest`): data nodes match it
    )
    data_source: DataSource | None = None  # None (definitions from before it): what `data` names
    swarmnode_version: str = __version__  # of the bootstrap that published the run
    protocol_version: int = PROTOCOL_VERSION  # the wire protocol (`protocols.messages`) every node must speak
    hop_timeout_s: float = 10.0
    iteration_timeout_s: float = 30.0
    record_period_s: float = 1.0
    record_ttl_s: float = 4.0

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            expected = {"int": int, "float": (int, float), "bool": bool, "str": str}.get(str(field.type))
            if expected is not None and (
                not isinstance(value, expected) or isinstance(value, bool) != (expected is bool)
            ):
                raise RunSpecError(f"run field {field.name!r} must be {field.type}, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise RunSpecError(f"run field {field.name!r} must be finite, got {value!r}")
        if not self.run_id or "." in self.run_id or len(self.run_id) > 64:
            raise RunSpecError(f"run id {self.run_id!r} must be 1-64 characters without '.'")
        if self.data is not None and not isinstance(self.data, str):
            raise RunSpecError(f"run field 'data' must be a path string or null, got {self.data!r}")
        if self.data_source is not None:
            if not isinstance(self.data_source, DataSource):
                raise RunSpecError(f"run field 'data_source' must be a mapping, got {self.data_source!r}")
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
        if self.stages < 1 or preset.model.n_layers % self.stages:
            raise RunSpecError(
                f"{preset.model.n_layers} layers of preset {self.preset!r} "
                f"do not divide into {self.stages} stages"
            )
        positive = (
            "vocab_size",
            "microbatches",
            "min_data_nodes",
            "batch_size",
            "seq_len",
            "total_steps",
            "node_memory",
            "noloco_inner_steps",
            "copy_refresh_steps",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise RunSpecError(f"run field {name!r} must be at least 1")
        for name in (
            "lr",
            "max_grad_norm",
            "hop_timeout_s",
            "iteration_timeout_s",
            "record_period_s",
            "record_ttl_s",
        ):
            if getattr(self, name) <= 0:
                raise RunSpecError(f"run field {name!r} must be positive")
        if self.seq_len > preset.model.max_seq_len:
            raise RunSpecError(
                f"seq_len {self.seq_len} exceeds the preset's context {preset.model.max_seq_len}"
            )
        if not 0.0 <= self.skip_ratio < 1.0:
            raise RunSpecError(f"skip_ratio must be in [0, 1), got {self.skip_ratio}")
        if self.compression not in COMPRESSIONS:
            raise RunSpecError(
                f"compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}"
            )
        if self.dtype not in COMPUTE_DTYPE_NAMES:
            raise RunSpecError(f"dtype must be one of {', '.join(COMPUTE_DTYPE_NAMES)}, got {self.dtype!r}")
        if self.init_digests is not None:
            digests = self.init_digests.split(",") if isinstance(self.init_digests, str) else []
            if len(digests) != self.stages + 1 or not all(_SHA256.fullmatch(d) for d in digests):
                raise RunSpecError(
                    f"init_digests must be {self.stages + 1} SHA-256 hex digests (stages 0..{self.stages}), "
                    "comma separated"
                )
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
            if raw.get("data_source") is not None:
                raw = {**raw, "data_source": DataSource.from_dict(raw["data_source"])}
            return cls(**raw)
        except SourceSpecError as error:
            raise RunSpecError(f"run field 'data_source': {error}") from None
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
