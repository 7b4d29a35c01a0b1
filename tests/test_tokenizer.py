"""Tokenizer: byte-level BPE training, round trips, loading user files, the training cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models

from swarmnode import tokenizer as tokenizer_module
from swarmnode.datasource import DataError, Source, default_source
from swarmnode.tokenizer import (
    EOS_TOKEN,
    cached_tokenizer,
    eos_id,
    file_digest,
    load_tokenizer,
    train_tokenizer,
)

SAMPLE = "def f(x):\r\n\treturn x  # ünïcödé, 数字, emoji 🐍\n\n    trailing spaces   \n"


@pytest.fixture(scope="module")
def stdlib_subset() -> Source:
    """The first 30 files of the real standard library corpus: real text, small enough to train on fast."""
    full = default_source()
    return Source(full.root, full.files[:30], "subset")


@pytest.fixture(scope="module")
def small_tokenizer(stdlib_subset: Source) -> Tokenizer:
    return train_tokenizer((doc.text for doc in stdlib_subset.documents()), vocab_size=512)


@pytest.fixture(scope="module")
def text_tokenizer(small_tokenizer: Tokenizer) -> Tokenizer:
    """The small tokenizer as the corpus encoder uses it: a literal end-of-text in a document is text."""
    tokenizer = Tokenizer.from_str(small_tokenizer.to_str())
    tokenizer.encode_special_tokens = True
    return tokenizer


def test_eos_is_id_zero_and_vocab_size_is_met(small_tokenizer: Tokenizer) -> None:
    assert eos_id(small_tokenizer) == 0
    assert small_tokenizer.token_to_id(EOS_TOKEN) == 0
    assert small_tokenizer.get_vocab_size() == 512


def test_round_trip_on_real_source(small_tokenizer: Tokenizer, stdlib_subset: Source) -> None:
    for doc in stdlib_subset.documents():
        ids = small_tokenizer.encode(doc.text, add_special_tokens=False).ids
        assert small_tokenizer.decode(ids) == doc.text


def test_round_trip_on_unusual_text(small_tokenizer: Tokenizer) -> None:
    ids = small_tokenizer.encode(SAMPLE).ids
    assert small_tokenizer.decode(ids) == SAMPLE


@settings(max_examples=50, deadline=None)
@given(text=st.text())
def test_round_trip_on_any_text(text_tokenizer: Tokenizer, text: str) -> None:
    ids = text_tokenizer.encode(text).ids
    assert text_tokenizer.decode(ids) == text


def test_literal_end_of_text_is_encoded_as_text(text_tokenizer: Tokenizer) -> None:
    text = f"a {EOS_TOKEN} b"
    ids = text_tokenizer.encode(text).ids
    assert eos_id(text_tokenizer) not in ids
    assert text_tokenizer.decode(ids) == text


def test_training_is_deterministic(stdlib_subset: Source) -> None:
    texts = [doc.text for doc in stdlib_subset.documents()][:10]
    assert train_tokenizer(texts, 400).to_str() == train_tokenizer(texts, 400).to_str()


def test_too_small_vocab_is_rejected() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], 100)


def test_cached_tokenizer_trains_once(
    tmp_path: Path, stdlib_subset: Source, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = cached_tokenizer(stdlib_subset, 300, tmp_path)
    assert path.name == "tokenizer-subset-v300.json"
    assert load_tokenizer(path).get_vocab_size() == 300
    assert not list(tmp_path.glob("*.tmp"))

    def fail(*args: object) -> Tokenizer:
        raise AssertionError("retrained a cached tokenizer")

    monkeypatch.setattr(tokenizer_module, "train_tokenizer", fail)
    digest = file_digest(path)
    assert cached_tokenizer(stdlib_subset, 300, tmp_path) == path
    assert file_digest(path) == digest


@pytest.mark.parametrize(
    "content",
    ["{not json", json.dumps({"version": "1.0"}), ""],
    ids=["bad-json", "not-a-tokenizer", "empty"],
)
def test_unparsable_tokenizer_is_a_data_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(content)
    with pytest.raises(DataError, match=r"not a valid tokenizer\.json") as info:
        load_tokenizer(path)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_tokenizer_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such tokenizer file"):
        load_tokenizer(tmp_path / "absent.json")


def test_tokenizer_without_end_of_text_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    Tokenizer(models.BPE()).save(str(path))
    with pytest.raises(DataError, match="no end-of-text token"):
        load_tokenizer(path)


def test_user_tokenizer_with_other_eos_is_accepted(tmp_path: Path) -> None:
    tokenizer = Tokenizer(models.WordLevel({"</s>": 0, "a": 1, "[UNK]": 2}, unk_token="[UNK]"))
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    assert eos_id(load_tokenizer(path)) == 0
