"""`--data hf:NAME[:CONFIG][:SPLIT]`: a Hugging Face dataset, read through `datasets.load_dataset`, streamed.

NAME is a dataset on the hub (`HuggingFaceFW/fineweb`) or a local folder laid out as one (`./corpus`, with
`train.jsonl` and `test.jsonl`, or `data/train-*.parquet`: `datasets` infers the format and the splits from
the file names), read the same way. The dataset is streamed (`streaming=True`): rows are read as they are
encoded, nothing is downloaded whole or converted to Arrow first. Each row's `text_column` is a document,
keyed `{split}#{row}` for the held-out split. `datasets` is imported only here, when an `hf:` source is
used: it is an optional extra (`pip install 'swarmnode[hf]'`).

Opening a source checks it at once, in one line naming the thing at fault: a dataset that does not exist,
a split it lacks, a column it lacks, a split with no rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmnode.datasource import DataError, Document, fingerprint, is_validation, one_line
from swarmnode.source_spec import HF_PREFIX

COLUMNS_SHOWN = 8  # columns listed when the text column is missing


@dataclass(frozen=True)
class HFSource:
    """One split of a dataset: `name`, `config` (None: the default), `split` and the text's column."""

    name: str
    config: str | None
    split_name: str
    text_column: str
    identity: str
    fingerprint: str

    @property
    def label(self) -> str:
        return f"{HF_PREFIX}{self.name}:{self.config or ''}:{self.split_name}"

    def documents(self) -> Iterator[Document]:
        """Yield the non-empty texts of the split's rows, in the dataset's order."""
        for row, record in enumerate(_rows(self)):
            text = record.get(self.text_column)
            if isinstance(text, str) and text:
                yield Document(f"{self.split_name}#{row}", text)

    def split(self, validation: bool) -> Iterator[Document]:
        """Yield the documents of one side of the held-out split."""
        return (doc for doc in self.documents() if is_validation(doc.key) == validation)


def hf_source(name: str, config: str | None, split: str, text_column: str) -> HFSource:
    """The split `split` of dataset `name` (config `config`), checked: DataError names what is missing."""
    label = f"{HF_PREFIX}{name}:{config or ''}:{split}"
    folder = Path(name).expanduser()
    if folder.is_dir():
        listing: list[object] = [(p.relative_to(folder).as_posix(), p.stat().st_size) for p in _files(folder)]
        stamps: list[object] = [str(folder.resolve()), *(p.stat().st_mtime_ns for p in _files(folder))]
    else:
        listing, stamps = [], []
    shared = fingerprint([name, config, split, text_column, *listing])
    source = HFSource(
        name, config, split, text_column, f"hf-{fingerprint([shared, *stamps])}", f"hf-{shared}"
    )
    dataset = _load(source, label)
    first = next(iter(dataset), None)
    if first is None:
        raise DataError(f"{label}: split {split!r} has no rows")
    columns = list(dataset.column_names or first)  # None when streamed features are unknown
    if text_column not in columns:
        shown = ", ".join(columns[:COLUMNS_SHOWN]) + (", ..." if len(columns) > COLUMNS_SHOWN else "")
        raise DataError(f"{label}: no column {text_column!r} (it has {shown}; --text-column names it)")
    return source


def _files(folder: Path) -> list[Path]:
    """The folder's files, hidden ones (`.cache` that `datasets` may write, `.git`) left out."""
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def _rows(source: HFSource) -> Iterator[dict[str, Any]]:
    dataset = _load(source, source.label)
    yield from dataset


def _load(source: HFSource, label: str) -> Any:
    """The streamed split; DataError for a dataset, config or split that does not exist."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{label}: hf: data needs the datasets library (pip install 'swarmnode[hf]')"
        ) from None
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(source.name, source.config, split=source.split_name, streaming=True)
    except datasets.exceptions.DatasetNotFoundError as error:
        raise DataError(f"{label}: no dataset {source.name!r} ({one_line(error)})") from None
    except FileNotFoundError as error:
        raise DataError(f"{label}: no dataset {source.name!r} ({one_line(error)})") from None
    except ValueError as error:
        text = one_line(error)
        if "split" in text.lower():
            raise DataError(f"{label}: no split {source.split_name!r} ({text})") from None
        if "config" in text.lower():
            raise DataError(f"{label}: no config {source.config!r} ({text})") from None
        raise DataError(f"{label}: no dataset or folder {source.name!r} ({text})") from None
    except Exception as error:  # datasets raises many kinds (network, format); the user needs one line
        raise DataError(
            f"{label}: cannot read the dataset ({type(error).__name__}: {one_line(error)})"
        ) from None
