"""What a run says about its data (`RunSpec.data_source`), so that every data node obtains the same text.

`--data` takes nothing (the default corpus: the running Python's standard library), a path (a `.txt`,
`.jsonl` or `.parquet` file, or a folder of them: the same path must hold the same files on every data
node), or `hf:NAME[:CONFIG][:SPLIT]`: a Hugging Face dataset read through `datasets.load_dataset` (NAME a
dataset on the hub, or a local folder laid out as one; split `train` unless named; an empty CONFIG, as in
`hf:NAME::test`, is the dataset's default). `text_column` names the JSONL field, Parquet column or
dataset column that holds the text. `fingerprint` is what the bootstrap's copy of the data looked like
(its files' names and sizes, or the dataset's name), comparable across machines: a data node whose copy
differs is told so. Torch-free and light: the CLI imports it for `--help`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

KINDS = ("default", "local", "hf")
HF_PREFIX = "hf:"
DEFAULT_TEXT_COLUMN = "text"
DEFAULT_HF_SPLIT = "train"
MAX_CHARS = 1024  # of any field: the run definition stays small


class SourceSpecError(ValueError):
    """A data source that cannot be described (a bad `--data`/`--text-column`, or a bad run field)."""


@dataclass(frozen=True)
class DataSource:
    """Where a run's text comes from: `kind` (default, local or hf), `name` (the path or the dataset),
    `config` and `split` (hf only), `text_column`, and the bootstrap's `fingerprint` of it (None: unknown)."""

    kind: str = "default"
    name: str | None = None
    config: str | None = None
    split: str | None = None
    text_column: str = DEFAULT_TEXT_COLUMN
    fingerprint: str | None = None

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if value is not None and (not isinstance(value, str) or len(value) > MAX_CHARS):
                raise SourceSpecError(f"data source field {field.name!r} must be text, got {value!r}")
        if self.kind not in KINDS:
            raise SourceSpecError(f"data source kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not self.text_column:
            raise SourceSpecError("the text column needs a name")
        if (self.kind == "default") != (self.name is None) or (self.name is not None and not self.name):
            raise SourceSpecError(
                f"a {self.kind} data source {'has no' if self.kind == 'default' else 'needs a'} name"
            )
        if self.kind != "hf" and (self.config is not None or self.split is not None):
            raise SourceSpecError("only an hf: data source has a config and a split")
        if self.kind == "hf" and not self.split:
            raise SourceSpecError("an hf: data source needs a split")
        if self.kind == "default" and self.text_column != DEFAULT_TEXT_COLUMN:
            raise SourceSpecError("the default corpus has no text column to choose")

    @classmethod
    def parse(cls, data: str | None, text_column: str | None = None) -> DataSource:
        """The source `--data` and `--text-column` name (see the module's docstring)."""
        column = DEFAULT_TEXT_COLUMN if text_column is None else text_column
        chosen = text_column not in (None, DEFAULT_TEXT_COLUMN)
        if data is None:
            if chosen:
                raise SourceSpecError(
                    "--text-column applies to .jsonl, .parquet and hf: data, not the default corpus"
                )
            return cls()
        if not data.startswith(HF_PREFIX):
            if chosen and data.endswith(".txt"):
                raise SourceSpecError(f"--text-column applies to .jsonl, .parquet and hf: data, not {data}")
            return cls("local", data, text_column=column)
        parts = data[len(HF_PREFIX) :].split(":")
        if len(parts) > 3 or not parts[0]:
            raise SourceSpecError(f"{data!r} is not hf:NAME[:CONFIG][:SPLIT]")
        name, config, split = (*parts, "", "")[:3]
        return cls("hf", name, config or None, split or DEFAULT_HF_SPLIT, column)

    def locator(self) -> DataSource:
        """This source without its fingerprint: what a `--data` string and `--text-column` say."""
        return DataSource(self.kind, self.name, self.config, self.split, self.text_column)

    def __str__(self) -> str:
        """The `--data` form (`hf:` with every part), or "the default corpus"."""
        if self.kind == "default":
            return "the default corpus"
        if self.kind == "local":
            return str(self.name)
        return f"{HF_PREFIX}{self.name}:{self.config or ''}:{self.split}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: object) -> DataSource:
        """Parse a run definition's `data_source`; SourceSpecError names what is wrong."""
        if not isinstance(raw, dict):
            raise SourceSpecError(f"data_source must be a mapping, got {type(raw).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(map(str, raw)) - set(known))
        if unknown:
            raise SourceSpecError(
                f"unknown data_source field(s): {', '.join(unknown)}; the fields are {', '.join(known)}"
            )
        return cls(**raw)
