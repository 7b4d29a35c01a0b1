"""Tokenizers: Hugging Face `tokenizer.json` files, and the default byte-level BPE trained and cached here.

The default tokenizer is trained on the training split of a source (the standard library by default) with
the `tokenizers` library and cached as `tokenizer-{source identity}-v{vocab size}.json`. One process trains
it under a file lock and renames it into place; every other process waits for the lock and reads the file.
Training is deterministic, so machines with the same source build the same file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from protocols.transfers import MAX_TOKENIZER_BYTES
from swarmnode.datasource import DataError, TextSource, atomic_write, file_lock, one_line
from swarmnode.progress import enabled as progress_enabled
from swarmnode.progress import progress

EOS_TOKEN = "<|endoftext|>"
# End-of-text tokens recognised in a user's tokenizer.json, in order of preference.
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
DEFAULT_VOCAB_SIZE = 4096
_MIN_VOCAB_SIZE = 257  # 256 byte tokens and the end-of-text token
DIGEST_CHARS = 16  # hex characters of a tokenizer's SHA-256 kept as its digest


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, show_progress: bool = False
) -> Tokenizer:
    """Train a byte-level BPE tokenizer (with `EOS_TOKEN` as id 0) on `texts`; `show_progress`: the
    `tokenizers` library's own bars for counting pairs and computing merges, on stderr."""
    if vocab_size < _MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {_MIN_VOCAB_SIZE}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def load_tokenizer(path: Path) -> Tokenizer:
    """Load a `tokenizer.json`; raise `DataError` if it is missing, too large to travel, does not parse or
    has no end-of-text."""
    path = path.expanduser()
    if not path.is_file():
        raise DataError(f"{path}: no such tokenizer file")
    if path.stat().st_size > MAX_TOKENIZER_BYTES:
        limit = MAX_TOKENIZER_BYTES >> 20
        raise DataError(f"{path}: over the {limit} MiB a run's tokenizer may have (it travels to data nodes)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:
        raise DataError(f"{path}: not a valid tokenizer.json ({one_line(exc)})") from None
    eos_id(tokenizer, path)
    return tokenizer


def eos_id(tokenizer: Tokenizer, path: Path | None = None) -> int:
    """The id of the tokenizer's end-of-text token, appended after every document."""
    for token in EOS_CANDIDATES:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    where = f"{path}: " if path is not None else ""
    raise DataError(f"{where}tokenizer has no end-of-text token (one of {', '.join(EOS_CANDIDATES)})")


def cached_tokenizer(source: TextSource, vocab_size: int, cache: Path) -> Path:
    """The path of the tokenizer trained on `source`'s training split, training it once if not cached."""
    path = cache / f"tokenizer-{source.identity}-v{vocab_size}.json"
    if path.is_file():
        return path
    with file_lock(path):
        if not path.is_file():
            texts = progress(_train_texts(source), f"training the tokenizer on {source.label}", "docs")
            tokenizer = train_tokenizer(texts, vocab_size, progress_enabled())
            data = tokenizer.to_str().encode("utf-8")
            atomic_write(path, lambda handle: handle.write(data))
    return path


def file_digest(path: Path) -> str:
    """A short SHA-256 of a file's bytes, naming what was built from it (and comparable across machines)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:DIGEST_CHARS]


def _train_texts(source: TextSource) -> Iterable[str]:
    """The training split's texts; all texts when the source is too small to have a training document."""
    seen = False
    for doc in source.split(validation=False):
        seen = True
        yield doc.text
    if not seen:
        yield from (doc.text for doc in source.documents())
