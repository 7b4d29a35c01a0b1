"""Where training text comes from: the default corpus, the user's files, the held-out split and the cache.

The default corpus is the source of the running interpreter's standard library (`*.py`, without its test
folders). `--data PATH` names a `.txt`, `.jsonl` (a "text" field per line, or `--text-column`'s) or
`.parquet` (a "text" column, or `--text-column`'s) file, or a folder searched recursively for them. Every
such source is a sorted list of files, read in that order, and yields documents: a whole `.py`/`.txt`
file, one JSONL line, one Parquet row. `hf:` sources are read by `swarmnode.hf_data`.

Validation split: a document is held out when a hash of its key (relative path, plus `:line` or `#row`)
falls in the lowest `VAL_FRACTION` of the hash range. The rule depends only on the key, so every machine
agrees on it and no file ever feeds both splits. When a source is too small for that to give both splits
a document (one `.txt` file, say), the caller falls back to holding out the tail of the tokens.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NamedTuple, Protocol

import pyarrow.parquet as pq

from swarmnode.source_spec import DEFAULT_TEXT_COLUMN

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".parquet")
# Test suites, installed packages and the build-configuration files whose content names local install paths.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
VAL_FRACTION = 0.02
# Bump when the split rule or document boundaries change, so that cached files built the old way are unused.
FORMAT_VERSION = 1


class DataError(ValueError):
    """The data or tokenizer a user named cannot be used; the message is one line naming the path."""


class Document(NamedTuple):
    """One unit of text: `key` identifies it for the split, `text` is its content."""

    key: str
    text: str


class TextSource(Protocol):
    """Documents and their names: `identity` names cache files (it changes when this machine's copy
    changes), `fingerprint` compares copies across machines, `label` names the source in messages."""

    @property
    def identity(self) -> str: ...

    @property
    def fingerprint(self) -> str: ...

    @property
    def label(self) -> str: ...

    def documents(self) -> Iterator[Document]: ...

    def split(self, validation: bool) -> Iterator[Document]: ...


@dataclass(frozen=True)
class Source:
    """A sorted list of text files under `root`, the identity used to name cache files, the column or field
    holding the text of `.jsonl`/`.parquet` files, and a fingerprint of names and sizes (None: `identity`)."""

    root: Path
    files: tuple[str, ...]
    identity: str
    text_column: str = DEFAULT_TEXT_COLUMN
    portable: str | None = None

    @property
    def fingerprint(self) -> str:
        return self.portable or self.identity

    @property
    def label(self) -> str:
        return str(self.root / self.files[0]) if len(self.files) == 1 else str(self.root)

    def documents(self) -> Iterator[Document]:
        """Yield the non-empty documents of every file, in order."""
        for rel in self.files:
            path = self.root / rel
            if path.suffix == ".jsonl":
                yield from _jsonl_documents(path, rel, self.text_column)
            elif path.suffix == ".parquet":
                yield from _parquet_documents(path, rel, self.text_column)
            else:
                text = path.read_bytes().decode("utf-8", errors="replace")
                if text:
                    yield Document(rel, text)

    def split(self, validation: bool) -> Iterator[Document]:
        """Yield the documents of one side of the held-out split."""
        return (doc for doc in self.documents() if is_validation(doc.key) == validation)


def is_validation(key: str) -> bool:
    """Whether the document with this key belongs to the held-out split."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < VAL_FRACTION * 2**64


def stdlib_files(root: Path) -> tuple[str, ...]:
    """The sorted relative paths of the `*.py` files under `root`, outside test and package folders."""
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        parts = rel.parts
        if EXCLUDED_DIRS.intersection(parts[:-1]) or parts[0].startswith("config-"):
            continue
        if parts[-1].startswith("_sysconfigdata") or not path.is_file():
            continue
        files.append(rel.as_posix())
    return tuple(sorted(files))


def default_source(root: Path | None = None) -> Source:
    """The standard library of the running interpreter (or the tree at `root`) as a source."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    files = stdlib_files(root)
    if not files:
        raise DataError(f"{root}: no Python files for the default corpus")
    sizes: list[object] = [(rel, (root / rel).stat().st_size) for rel in files]
    return Source(root, files, f"py{platform.python_version()}-{fingerprint(sizes)}")


def user_source(path: Path, text_column: str = DEFAULT_TEXT_COLUMN) -> Source:
    """The `.txt`, `.jsonl` and `.parquet` files at `path`: a file, or a folder (hidden folders skipped);
    `text_column` names the field or column of the text in `.jsonl` and `.parquet` files."""
    path = path.expanduser()
    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    if path.is_dir():
        root = path
        files = sorted(
            p.relative_to(root).as_posix()
            for p in root.rglob("*")
            if p.suffix in SUPPORTED_SUFFIXES
            and p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
        if not files:
            kinds = ", ".join(SUPPORTED_SUFFIXES)
            raise DataError(f"{path}: folder holds no {kinds} files")
    else:
        if path.suffix not in SUPPORTED_SUFFIXES:
            raise DataError(f"{path}: unsupported file type (use {', '.join(SUPPORTED_SUFFIXES)})")
        root, files = path.parent, [path.name]
    stats = [(rel, (root / rel).stat()) for rel in files]
    if all(st.st_size == 0 for _, st in stats):
        raise DataError(f"{path}: empty")
    if text_column != DEFAULT_TEXT_COLUMN and not any(
        Path(rel).suffix in (".jsonl", ".parquet") for rel in files
    ):
        raise DataError(f"{path}: no .jsonl or .parquet file for --text-column {text_column!r}")
    listing: list[object] = [str(root.resolve()), text_column]
    listing += [(rel, st.st_size, st.st_mtime_ns) for rel, st in stats]
    portable: list[object] = [text_column, *((rel, st.st_size) for rel, st in stats)]
    identity, shared = f"data-{fingerprint(listing)}", f"files-{fingerprint(portable)}"
    return Source(root, tuple(files), identity, text_column, shared)


def fingerprint(listing: list[object]) -> str:
    """A short hash of a JSON-able listing (and the format version), naming what was built from it."""
    payload = json.dumps([FORMAT_VERSION, listing]).encode("utf-8")
    return hashlib.sha256(payload).hexdigest()[:16]


def _jsonl_documents(path: Path, rel: str, column: str) -> Iterator[Document]:
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            text = record.get(column) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(f'{path}:{number}: no string "{column}" field (--text-column names it)')
            if text:
                yield Document(f"{rel}:{number}", text)


def _parquet_documents(path: Path, rel: str, column: str) -> Iterator[Document]:
    try:
        table = pq.ParquetFile(path)
    except Exception as exc:
        raise DataError(f"{path}: not a readable Parquet file ({one_line(exc)})") from None
    names = table.schema_arrow.names
    if column not in names:
        raise DataError(f'{path}: no "{column}" column (it has {", ".join(names)}; --text-column names it)')
    row = 0
    for batch in table.iter_batches(columns=[column]):
        for text in batch.column(0).to_pylist():
            if isinstance(text, str) and text:
                yield Document(f"{rel}#{row}", text)
            row += 1


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message, for one-line `DataError`s."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def cache_dir() -> Path:
    """The cache folder: `$SWARMNODE_CACHE`, else `~/.cache/swarmnode`."""
    configured = os.environ.get("SWARMNODE_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "swarmnode"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path.lock` so that one process builds what others then read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write `path` through a temporary file in the same folder, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it private; the cache is shared by the user's daemons
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
