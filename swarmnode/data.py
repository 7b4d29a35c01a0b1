"""Training data: a tokenised corpus with a held-out split, shards for data nodes, and batches.

`load_corpus` resolves the source (the standard library by default, `--data PATH` or `--data hf:...`: a
`source_spec.DataSource`), the tokenizer (the
user's `tokenizer.json`, or the default byte-level BPE trained on the source and cached) and the token ids.
Ids are encoded once and cached beside the tokenizer as `tokens-{source}-{tokenizer digest}-{split}.npy`
(uint16, or uint32 for vocabularies over 65536), built under a file lock and renamed into place, then
memory-mapped, so daemons started together on one machine encode once and share the pages. An end-of-text
token follows every document.

The held-out split is by document (see `swarmnode.datasource`); a source with too few documents for that
holds out the last `VAL_FRACTION` of its tokens instead.
"""

from __future__ import annotations

import itertools
import os
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from tokenizers import Tokenizer

from swarmnode.datasource import (
    VAL_FRACTION,
    DataError,
    Document,
    TextSource,
    atomic_write,
    cache_dir,
    default_source,
    file_lock,
    is_validation,
    user_source,
)
from swarmnode.progress import progress
from swarmnode.source_spec import DataSource, SourceSpecError
from swarmnode.tokenizer import DEFAULT_VOCAB_SIZE, cached_tokenizer, eos_id, file_digest, load_tokenizer

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "Corpus",
    "DataError",
    "batches",
    "data_node_tokens",
    "encode_source",
    "load_corpus",
    "shard",
    "val_batches",
]

VALIDATION_SEQUENCES = 32  # windows of the validation set (`validation_set`)
_ENCODE_CHUNK = 64  # documents per encode_batch call: parallel enough, bounded memory
Tokens = TypeVar("Tokens", np.ndarray, torch.Tensor)


@dataclass(frozen=True)
class Corpus:
    """A tokenised corpus: the tokenizer and the 1-D token ids of both splits (read-only numpy arrays)."""

    tokenizer: Tokenizer
    tokenizer_path: Path
    tokenizer_digest: str
    source_identity: str
    eos_id: int
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    source_fingerprint: str = ""  # comparable across machines (`DataSource.fingerprint`)
    source_label: str = ""  # names the source in messages

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size, special tokens included (the model's embedding rows)."""
        return self.tokenizer.get_vocab_size()


def load_corpus(
    data: str | os.PathLike[str] | DataSource | TextSource | None = None,
    tokenizer_path: str | os.PathLike[str] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    cache: Path | None = None,
) -> Corpus:
    """Load (building and caching on first use) the tokenised corpus.

    `data`: `--data` (a path or `hf:...`), a `DataSource`, a source, or None for the standard library.
    `tokenizer_path`: a `tokenizer.json`, or None to train a byte-level BPE of `vocab_size` on the
    source's training split.
    `cache`: the cache folder, by default `$SWARMNODE_CACHE` or `~/.cache/swarmnode`.
    Raises `DataError` for unusable data or tokenizer files.
    """
    source = _source(data)
    cache = cache_dir() if cache is None else cache
    path = cached_tokenizer(source, vocab_size, cache) if tokenizer_path is None else Path(tokenizer_path)
    tokenizer = load_tokenizer(path)
    digest = file_digest(path)
    train, val = _cached_tokens(source, tokenizer, cache / f"tokens-{source.identity}-{digest}")
    about = (source.fingerprint, source.label)
    return Corpus(tokenizer, path, digest, source.identity, eos_id(tokenizer), train, val, *about)


def _source(data: str | os.PathLike[str] | DataSource | TextSource | None) -> TextSource:
    if data is None or isinstance(data, str | os.PathLike):
        try:
            spec = DataSource.parse(None if data is None else os.fspath(data))
        except SourceSpecError as error:
            raise DataError(str(error)) from None
        return open_source(spec)
    return open_source(data) if isinstance(data, DataSource) else data


def open_source(spec: DataSource) -> TextSource:
    """The source a run's `data_source` (or `--data`) describes; `hf:` ones need the `datasets` library."""
    if spec.kind == "default":
        return default_source()
    if spec.kind == "local":
        return user_source(Path(str(spec.name)), spec.text_column)
    from swarmnode.hf_data import hf_source

    return hf_source(str(spec.name), spec.config, str(spec.split), spec.text_column)


def encode_source(source: TextSource, tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Encode every document followed by end-of-text; return the (train, val) token ids."""
    eos = eos_id(tokenizer)
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 2**16 else np.uint32
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    # A literal "<|endoftext|>" inside a document is text, not a document boundary.
    previous, tokenizer.encode_special_tokens = tokenizer.encode_special_tokens, True
    try:
        documents = progress(source.documents(), f"encoding {source.label}", "docs")
        for chunk in _chunked(documents, _ENCODE_CHUNK):
            encodings = tokenizer.encode_batch([doc.text for doc in chunk], add_special_tokens=False)
            for doc, encoding in zip(chunk, encodings, strict=True):
                ids = np.empty(len(encoding.ids) + 1, dtype)
                ids[:-1] = encoding.ids
                ids[-1] = eos
                parts[is_validation(doc.key)].append(ids)
    finally:
        tokenizer.encode_special_tokens = previous
    if parts[False] and parts[True]:
        return np.concatenate(parts[False]), np.concatenate(parts[True])
    tokens = np.concatenate(parts[False] + parts[True]) if parts[False] or parts[True] else np.empty(0, dtype)
    if len(tokens) < 2:
        raise DataError(f"{source.label}: no text to train on")
    n_val = max(1, round(len(tokens) * VAL_FRACTION))
    return tokens[:-n_val], tokens[-n_val:]


def shard(tokens: Tokens, index: int, count: int) -> Tokens:
    """The `index`-th of `count` contiguous, disjoint blocks that together cover `tokens`."""
    if count < 1:
        raise ValueError(f"shard count must be at least 1, got {count}")
    if not 0 <= index < count:
        raise ValueError(f"shard index must be in [0, {count}), got {index}")
    n = len(tokens)
    return tokens[n * index // count : n * (index + 1) // count]


def data_node_tokens(
    tokens: np.ndarray, data_shard: tuple[int, int] | None, seed: int, node_id: str
) -> tuple[np.ndarray, int]:
    """What one data node reads, and the seed of its batch order: shard I/K of `tokens`, in an order fixed by
    the run's `seed` and I; without a shard, all of `tokens`, in an order of the node's own (from its id), so
    that data nodes started alike (the replicas of one compose service) do not train on the same batches."""
    if data_shard is None:
        return tokens, seed * 7919 + zlib.crc32(node_id.encode())
    index, count = data_shard
    return shard(tokens, index, count), seed * 7919 + index


def batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random (inputs, targets) int64 batches of shape (batch_size, seq_len), targets shifted by one.

    Window starts are drawn uniformly by a generator made from `seed` alone, so a seed fixes the stream. The
    shape is checked here, not at the first batch drawn: a shard too small for one batch is refused at start.
    """
    high = _check_windows(tokens, batch_size, seq_len)
    rng = np.random.default_rng(seed)
    return (_windows(tokens, rng.integers(0, high, size=batch_size), seq_len) for _ in itertools.count())


def validation_set(
    tokens: np.ndarray, batch_size: int, seq_len: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The validation batches every swarm figure is measured on: `VALIDATION_SEQUENCES` fixed windows
    (at least one batch), the same for the single-process trainer and the data nodes of a run."""
    return val_batches(tokens, batch_size, seq_len, max(1, VALIDATION_SEQUENCES // batch_size))


def val_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n_batches` fixed (inputs, targets) batches, windows spread evenly over `tokens` (validation)."""
    if n_batches < 1:
        raise ValueError(f"n_batches must be at least 1, got {n_batches}")
    high = _check_windows(tokens, batch_size, seq_len)
    starts = np.linspace(0, high - 1, batch_size * n_batches).round().astype(np.int64)
    return [_windows(tokens, row, seq_len) for row in starts.reshape(n_batches, batch_size)]


def check_run_data(corpus: Corpus, source: DataSource, tokenizer_digest: str | None, vocab_size: int) -> None:
    """DataError, in one line saying what differs and what to do, if a data node's `corpus` is not the
    run's: another tokenizer (vocabulary or digest), or another copy of the run's `source`."""
    mine = f"this node's tokenizer ({corpus.tokenizer_path}"
    fetch = "drop --tokenizer to fetch the run's from the bootstrap, or pass the run's tokenizer.json"
    if corpus.vocab_size != vocab_size:
        raise DataError(f"{mine}) has {corpus.vocab_size} tokens, the run's model {vocab_size}: {fetch}")
    if tokenizer_digest is not None and corpus.tokenizer_digest != tokenizer_digest:
        raise DataError(
            f"{mine}, digest {corpus.tokenizer_digest}) is not the run's (digest {tokenizer_digest}): "
            f"data nodes must tokenise alike; {fetch}"
        )
    theirs = source.fingerprint
    if theirs is None or theirs == corpus.source_fingerprint:
        return
    if source.kind == "default":
        version = theirs.removeprefix("py").split("-")[0]
        todo = f"the default corpus is this Python's standard library: run this node with Python {version}"
    elif source.kind == "local":
        todo = f"give this node the run's files at {source.name}"
    else:
        todo = f"give this node the bootstrap's copy of {source.name}"
    raise DataError(
        f"this node's data ({corpus.source_label}, fingerprint {corpus.source_fingerprint}) is not the run's "
        f"({source}, fingerprint {theirs}): {todo}"
    )


def check_splits(corpus: Corpus, seq_len: int, source: str) -> None:
    """DataError naming `source` and the split if a split is too short for one window of `seq_len`."""
    for split, tokens in (("training", corpus.train_tokens), ("validation", corpus.val_tokens)):
        if len(tokens) < seq_len + 1:
            raise DataError(
                f"{source}: its {split} split has {len(tokens)} tokens, fewer than the {seq_len + 1} "
                f"(sequence length + 1) one batch needs; give more text"
            )


def _check_windows(tokens: np.ndarray, batch_size: int, seq_len: int) -> int:
    """Validate the batch shape; return the number of possible window starts."""
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    if len(tokens) < seq_len + 1:
        raise ValueError(f"need at least seq_len + 1 = {seq_len + 1} tokens, have {len(tokens)}")
    return len(tokens) - seq_len


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.from_numpy(tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _cached_tokens(source: TextSource, tokenizer: Tokenizer, stem: Path) -> tuple[np.ndarray, np.ndarray]:
    paths = (stem.with_name(stem.name + "-train.npy"), stem.with_name(stem.name + "-val.npy"))
    if not all(path.is_file() for path in paths):
        with file_lock(stem):
            if not all(path.is_file() for path in paths):
                for path, array in zip(paths, encode_source(source, tokenizer), strict=True):
                    atomic_write(path, lambda handle, array=array: np.save(handle, array))
    train, val = (np.load(path, mmap_mode="r") for path in paths)
    return train, val


def _chunked(documents: Iterable[Document], size: int) -> Iterator[list[Document]]:
    iterator = iter(documents)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk
