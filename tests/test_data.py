"""Data: corpus listing, the held-out split, user files, the token cache, shards and batches."""

from __future__ import annotations

import json
import sysconfig
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swarmnode import data as data_module
from swarmnode import tokenizer as tokenizer_module
from swarmnode.data import (
    Corpus,
    DataError,
    batches,
    data_node_tokens,
    encode_source,
    load_corpus,
    shard,
    val_batches,
)
from swarmnode.datasource import (
    EXCLUDED_DIRS,
    Source,
    default_source,
    is_validation,
    stdlib_files,
    user_source,
)
from swarmnode.tokenizer import EOS_TOKEN, train_tokenizer

VOCAB = 300


@pytest.fixture
def stdlib_tree(tmp_path: Path) -> Path:
    """A small fake standard library: 150 modules, plus files that the default corpus must skip."""
    root = tmp_path / "lib"
    for i in range(150):
        module = root / ("pkg" if i % 3 else "") / f"mod{i:03d}.py"
        module.parent.mkdir(parents=True, exist_ok=True)
        module.write_text(f'"""Module {i}."""\n\n\ndef function_{i}(value):\n    return value * {i}\n')
    (root / "pkg" / "__init__.py").write_text("")
    for skipped in [
        "test/test_os.py",
        "pkg/tests/test_pkg.py",
        "idlelib/idle_test/test_x.py",
        "site-packages/third_party.py",
        "config-3.11-x86_64-linux-gnu/python-config.py",
        "_sysconfigdata__linux.py",
        "pkg/notes.txt",
    ]:
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_text("SKIPPED = True\n")
    return root


@pytest.fixture
def corpus(stdlib_tree: Path, tmp_path: Path) -> Corpus:
    return load_corpus(default_source(stdlib_tree), vocab_size=VOCAB, cache=tmp_path / "cache")


def test_real_stdlib_listing_is_deterministic_and_has_no_tests() -> None:
    source = default_source()
    assert source.root == Path(sysconfig.get_paths()["stdlib"])
    assert source == default_source()
    assert list(source.files) == sorted(source.files)
    assert len(source.files) > 300
    assert all(name.endswith(".py") for name in source.files)
    assert not any(EXCLUDED_DIRS.intersection(Path(name).parts) for name in source.files)
    assert "os.py" in source.files and "json/decoder.py" in source.files
    megabytes = sum((source.root / name).stat().st_size for name in source.files) / 1e6
    assert 5 < megabytes < 40
    fraction = sum(map(is_validation, source.files)) / len(source.files)
    assert 0.005 < fraction < 0.05


def test_stdlib_listing_skips_tests_packages_and_build_config(stdlib_tree: Path) -> None:
    files = stdlib_files(stdlib_tree)
    assert len(files) == 151
    assert "pkg/__init__.py" in files and "mod000.py" in files
    assert not [name for name in files if "test" in name or "config" in name or "third" in name]
    assert default_source(stdlib_tree).identity == default_source(stdlib_tree).identity


def test_split_is_deterministic_disjoint_and_complete(stdlib_tree: Path) -> None:
    source = default_source(stdlib_tree)
    val = [doc.key for doc in source.split(validation=True)]
    train = [doc.key for doc in source.split(validation=False)]
    assert val and train
    assert not set(val) & set(train)
    assert sorted(val + train) == sorted(doc.key for doc in source.documents())
    assert val == [doc.key for doc in default_source(stdlib_tree).split(validation=True)]


def test_corpus_holds_out_whole_documents(corpus: Corpus, stdlib_tree: Path) -> None:
    assert corpus.vocab_size == VOCAB
    assert corpus.train_tokens.dtype == np.uint16
    source = default_source(stdlib_tree)
    train_text = corpus.tokenizer.decode(corpus.train_tokens.tolist())
    val_text = corpus.tokenizer.decode(corpus.val_tokens.tolist())
    for doc in source.split(validation=True):
        assert doc.text in val_text and doc.text not in train_text
    for doc in source.split(validation=False):
        assert doc.text in train_text and doc.text not in val_text
    documents = sum(1 for _ in source.documents())
    eos_count = np.count_nonzero(corpus.train_tokens == corpus.eos_id)
    assert eos_count + np.count_nonzero(corpus.val_tokens == corpus.eos_id) == documents
    assert corpus.train_tokens[-1] == corpus.val_tokens[-1] == corpus.eos_id


def test_corpus_is_cached_and_shared_by_concurrent_loaders(
    stdlib_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"train": 0, "encode": 0}

    def counted(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(tokenizer_module, "train_tokenizer", counted("train", train_tokenizer))
    monkeypatch.setattr(data_module, "encode_source", counted("encode", encode_source))
    source = default_source(stdlib_tree)
    results: list[Corpus] = []
    threads = [
        threading.Thread(target=lambda: results.append(load_corpus(source, vocab_size=VOCAB, cache=tmp_path)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == {"train": 1, "encode": 1}
    assert len(results) == 4
    assert len({corpus.tokenizer_digest for corpus in results}) == 1
    for corpus in results[1:]:
        assert np.array_equal(corpus.train_tokens, results[0].train_tokens)
    assert not list(tmp_path.glob("*.tmp"))
    again = load_corpus(source, vocab_size=VOCAB, cache=tmp_path)
    assert calls == {"train": 1, "encode": 1}
    assert np.array_equal(again.val_tokens, results[0].val_tokens)


def test_user_tokenizer_is_used(corpus: Corpus, stdlib_tree: Path, tmp_path: Path) -> None:
    mine = load_corpus(default_source(stdlib_tree), corpus.tokenizer_path, cache=tmp_path / "other")
    assert mine.tokenizer_digest == corpus.tokenizer_digest
    assert np.array_equal(mine.train_tokens, corpus.train_tokens)
    assert not list((tmp_path / "other").glob("tokenizer-*"))


def test_txt_jsonl_and_parquet_all_load(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    (folder / "nested").mkdir(parents=True)
    (folder / "a.txt").write_text("plain text file\n")
    lines = [json.dumps({"text": f"json line {i}", "id": i}) for i in range(60)]
    (folder / "nested" / "b.jsonl").write_text("\n".join(lines[:30]) + "\n\n" + "\n".join(lines[30:]))
    pq.write_table(pa.table({"text": [f"parquet row {i}" for i in range(60)]}), folder / "c.parquet")
    (folder / "ignored.csv").write_text("text\nnot me\n")
    (folder / ".hidden").mkdir()
    (folder / ".hidden" / "x.txt").write_text("not me\n")
    source = user_source(folder)
    assert source.files == ("a.txt", "c.parquet", "nested/b.jsonl")
    corpus = load_corpus(folder, vocab_size=VOCAB, cache=tmp_path / "cache")
    text = corpus.tokenizer.decode(np.concatenate([corpus.train_tokens, corpus.val_tokens]).tolist())
    for expected in ["plain text file", "json line 0", "json line 59", "parquet row 0", "parquet row 59"]:
        assert expected in text
    assert "not me" not in text
    assert len(corpus.val_tokens) > 0


def test_single_text_file_holds_out_its_tail(tmp_path: Path) -> None:
    path = tmp_path / "book.txt"
    path.write_text(f"one long book, with a literal {EOS_TOKEN} inside. " * 100)
    corpus = load_corpus(path, vocab_size=VOCAB, cache=tmp_path / "cache")
    assert np.count_nonzero(corpus.train_tokens == corpus.eos_id) == 0
    assert list(corpus.val_tokens).count(corpus.eos_id) == 1
    total = len(corpus.train_tokens) + len(corpus.val_tokens)
    assert len(corpus.val_tokens) == round(total * 0.02)
    joined = np.concatenate([corpus.train_tokens, corpus.val_tokens[:-1]]).tolist()
    assert corpus.tokenizer.decode(joined) == path.read_text()


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.jsonl", '{"text": "ok"}\n{"text": \n', r"bad\.jsonl:2: not valid JSON"),
        ("bad.jsonl", '{"text": "ok"}\n{"body": "no text"}\n', r'bad\.jsonl:2: no string "text" field'),
        ("bad.jsonl", '["a list"]\n', r'bad\.jsonl:1: no string "text" field'),
        ("bad.parquet", None, r'bad\.parquet: no "text" column'),
        ("bad.parquet", "not parquet at all", r"bad\.parquet: not a readable Parquet file"),
        ("blank.txt", "", r"blank\.txt: empty"),
        ("blank.jsonl", "\n\n", r"no text to train on"),
        ("data.csv", "text\nhello\n", r"data\.csv: unsupported file type"),
    ],
)
def test_bad_data_files_are_data_errors(tmp_path: Path, name: str, content: str | None, message: str) -> None:
    path = tmp_path / name
    if content is None:
        pq.write_table(pa.table({"body": ["x"]}), path)
    else:
        path.write_text(content)
    with pytest.raises(DataError, match=message) as info:
        load_corpus(path, vocab_size=VOCAB, cache=tmp_path / "cache")
    assert "\n" not in str(info.value)


def test_missing_and_empty_paths_are_data_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file or folder") as info:
        load_corpus(tmp_path / "absent", cache=tmp_path)
    assert str(tmp_path / "absent") in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="folder holds no"):
        load_corpus(tmp_path / "empty", cache=tmp_path)
    (tmp_path / "empty" / "readme.md").write_text("no supported files here")
    with pytest.raises(DataError, match="folder holds no"):
        load_corpus(tmp_path / "empty", cache=tmp_path)
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        load_corpus(tmp_path / "empty", cache=tmp_path)


def test_empty_default_corpus_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no Python files"):
        default_source(tmp_path)


@given(n=st.integers(0, 300), count=st.integers(1, 12))
def test_shards_are_disjoint_and_cover(n: int, count: int) -> None:
    tokens = np.arange(n)
    shards = [shard(tokens, index, count) for index in range(count)]
    assert np.array_equal(np.concatenate(shards), tokens)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert [list(s) for s in shards] == [list(shard(tokens, index, count)) for index in range(count)]


def test_shard_works_on_tensors_and_rejects_bad_arguments() -> None:
    tokens = torch.arange(10)
    assert torch.equal(torch.cat([shard(tokens, 0, 3), shard(tokens, 1, 3), shard(tokens, 2, 3)]), tokens)
    for index, count in [(0, 0), (-1, 2), (2, 2), (5, 3)]:
        with pytest.raises(ValueError, match="shard"):
            shard(tokens, index, count)


def test_batches_are_deterministic_shifted_windows() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    stream = batches(tokens, 4, 16, seed=7)
    first = [next(stream) for _ in range(3)]
    again = batches(tokens, 4, 16, seed=7)
    for inputs, targets in first:
        repeat_inputs, repeat_targets = next(again)
        assert inputs.shape == targets.shape == (4, 16)
        assert inputs.dtype == targets.dtype == torch.int64
        assert torch.equal(inputs, repeat_inputs) and torch.equal(targets, repeat_targets)
        assert torch.equal(targets, inputs + 1)  # consecutive ids: targets are inputs shifted by one
        assert int(targets.max()) < 1000
    other, _ = next(batches(tokens, 4, 16, seed=8))
    assert not torch.equal(other, first[0][0])


def test_batches_reach_the_last_token_and_reject_short_input() -> None:
    tokens = np.arange(5, dtype=np.uint16)
    inputs, targets = next(batches(tokens, 3, 4, seed=0))
    assert inputs.tolist() == [[0, 1, 2, 3]] * 3 and targets.tolist() == [[1, 2, 3, 4]] * 3
    with pytest.raises(ValueError, match="at least seq_len"):
        next(batches(tokens, 1, 5, seed=0))
    with pytest.raises(ValueError, match="positive"):
        next(batches(tokens, 0, 2, seed=0))


def test_val_batches_are_fixed_and_spread(corpus: Corpus) -> None:
    fixed = val_batches(corpus.val_tokens, 2, 8, n_batches=3)
    assert len(fixed) == 3
    assert all(inputs.shape == targets.shape == (2, 8) for inputs, targets in fixed)
    again = val_batches(corpus.val_tokens, 2, 8, n_batches=3)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(fixed, again, strict=True))
    assert torch.equal(fixed[0][0][0], torch.from_numpy(corpus.val_tokens[:8].astype(np.int64)))
    assert torch.equal(fixed[-1][1][-1], torch.from_numpy(corpus.val_tokens[-8:].astype(np.int64)))
    with pytest.raises(ValueError, match="n_batches"):
        val_batches(corpus.val_tokens, 2, 8, n_batches=0)


def test_source_identity_changes_with_content(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_text("first")
    before = user_source(path).identity
    path.write_text("second version")
    assert user_source(path).identity != before
    assert isinstance(user_source(path), Source)


def test_data_nodes_read_their_shard_in_a_fixed_order_or_everything_in_their_own() -> None:
    tokens = np.arange(1000, dtype=np.int32)
    part, seed = data_node_tokens(tokens, (1, 4), 7, "12D3KooWA")
    assert np.array_equal(part, shard(tokens, 1, 4))
    assert data_node_tokens(tokens, (1, 4), 7, "12D3KooWB")[1] == seed  # a shard's order: the run's alone
    assert data_node_tokens(tokens, (2, 4), 7, "12D3KooWA")[1] != seed
    # without a shard (replicas of one compose service): all the data, each node in an order of its own
    (all_a, seed_a), (all_b, seed_b) = (data_node_tokens(tokens, None, 7, p) for p in ("12D3KooWA", "B"))
    assert np.array_equal(all_a, tokens) and np.array_equal(all_b, tokens)
    assert seed_a != seed_b and data_node_tokens(tokens, None, 7, "12D3KooWA")[1] == seed_a
    first_a, first_b = next(batches(all_a, 4, 16, seed_a))[0], next(batches(all_b, 4, 16, seed_b))[0]
    assert not torch.equal(first_a, first_b)
