"""Data for a real swarm: the run definition's `data_source`, `--text-column`, `hf:` datasets read through the
`datasets` library (on local folders: the hub cannot be reached here), a data node whose data is not the
run's, bad input as one-line errors, and progress bars."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click.testing
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from swarmnode.cli import main
from swarmnode.data import DataError, check_run_data, load_corpus
from swarmnode.datasource import user_source
from swarmnode.runspec import RunSpec, RunSpecError
from swarmnode.source_spec import DataSource, SourceSpecError

LINES = [f"def f_{i}(x):\n    return x * {i} + {i % 5}  # row {i}\n" for i in range(2000)]


def jsonl(path: Path, texts: list[str], column: str = "body") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({column: text, "id": i}) + "\n" for i, text in enumerate(texts)))
    return path


def one_line_error(result: click.testing.Result, *words: str) -> str:
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and all(word in errors[0] for word in words), result.output
    return errors[0]


def test_data_strings_parse_into_sources() -> None:
    assert DataSource.parse(None) == DataSource()
    assert DataSource.parse("corpus/") == DataSource("local", "corpus/")
    assert DataSource.parse("x.jsonl", "body") == DataSource("local", "x.jsonl", text_column="body")
    assert DataSource.parse("hf:org/set") == DataSource("hf", "org/set", None, "train")
    assert DataSource.parse("hf:org/set:en") == DataSource("hf", "org/set", "en", "train")
    assert DataSource.parse("hf:org/set::test", "content") == DataSource(
        "hf", "org/set", None, "test", "content"
    )
    assert str(DataSource.parse("hf:org/set:en:validation")) == "hf:org/set:en:validation"
    for bad in ("hf:", "hf:a:b:c:d"):
        with pytest.raises(SourceSpecError, match="hf:NAME"):
            DataSource.parse(bad)
    for data in (None, "notes.txt"):
        with pytest.raises(SourceSpecError, match="--text-column applies to"):
            DataSource.parse(data, "body")


def test_the_run_definition_carries_the_source_and_reads_older_ones() -> None:
    spec = RunSpec().with_data("hf:org/set:en", "content").with_fingerprint("hf-0123")
    raw = json.loads(json.dumps(spec.to_dict()))
    assert raw["data_source"] == {
        "kind": "hf",
        "name": "org/set",
        "config": "en",
        "split": "train",
        "text_column": "content",
        "fingerprint": "hf-0123",
    }
    assert RunSpec.from_dict(raw) == spec
    older = {k: v for k, v in raw.items() if k != "data_source"} | {"data": "corpus.jsonl"}
    assert RunSpec.from_dict(older).source == DataSource("local", "corpus.jsonl")
    with pytest.raises(RunSpecError, match="is not what 'data' names"):
        RunSpec.from_dict({**raw, "data": "other.jsonl"})
    with pytest.raises(RunSpecError, match=r"unknown data_source field\(s\): revision"):
        RunSpec.from_dict({**raw, "data_source": {**raw["data_source"], "revision": "main"}})
    assert RunSpec().with_data("notes.txt").with_data(None).source == DataSource("local", "notes.txt")


def test_text_column_names_the_jsonl_field_and_parquet_column(tmp_path: Path) -> None:
    jsonl(tmp_path / "a.jsonl", LINES[:3])
    pq.write_table(pa.table({"body": LINES[3:5], "n": [1, 2]}), tmp_path / "b.parquet")
    texts = [doc.text for doc in user_source(tmp_path, "body").documents()]
    assert texts == LINES[:5]
    with pytest.raises(DataError, match=r'a\.jsonl:1: no string "text" field \(--text-column'):
        list(user_source(tmp_path).documents())
    with pytest.raises(DataError, match=r'b\.parquet: no "content" column \(it has body, n'):
        list(user_source(tmp_path / "b.parquet", "content").documents())
    assert user_source(tmp_path, "body").identity != user_source(tmp_path).identity


def test_an_hf_folder_is_read_through_datasets_like_the_same_files(tmp_path: Path) -> None:
    folder = tmp_path / "hub-layout"
    jsonl(folder / "train.jsonl", LINES)
    jsonl(folder / "test.jsonl", LINES[:700])
    cache = tmp_path / "cache"
    train = load_corpus(DataSource.parse(f"hf:{folder}", "body"), cache=cache)
    test = load_corpus(DataSource.parse(f"hf:{folder}::test", "body"), train.tokenizer_path, cache=cache)
    local = load_corpus(
        DataSource.parse(str(folder / "train.jsonl"), "body"), train.tokenizer_path, cache=cache
    )
    assert train.source_label == f"hf:{folder}::train" and train.source_fingerprint.startswith("hf-")
    # the same rows, split by the same rule on other keys: the same number of tokens in all
    assert len(train.train_tokens) + len(train.val_tokens) == len(local.train_tokens) + len(local.val_tokens)
    assert len(test.train_tokens) + len(test.val_tokens) < len(train.train_tokens)
    assert 0 < len(train.val_tokens) < 0.1 * len(train.train_tokens)
    again = load_corpus(DataSource.parse(f"hf:{folder}", "body"), cache=cache)
    assert again.tokenizer_digest == train.tokenizer_digest and again.source_identity == train.source_identity


def test_parquet_shards_in_a_data_folder_are_one_split(tmp_path: Path) -> None:
    folder = tmp_path / ".store" / "shards"  # a hidden folder above the dataset's is no hidden file of it
    (folder / "data").mkdir(parents=True)
    for i in range(2):
        table = pa.table({"content": LINES[i * 1000 : (i + 1) * 1000]})
        pq.write_table(table, folder / "data" / f"train-0000{i}-of-00002.parquet")
    corpus = load_corpus(DataSource.parse(f"hf:{folder}", "content"), cache=tmp_path / "cache")
    assert corpus.vocab_size > 256 and len(corpus.train_tokens) > 10_000
    (folder / "data" / "train-00001-of-00002.parquet").unlink()
    pq.write_table(pa.table({"content": LINES[1000:1500]}), folder / "data" / "train-00001-of-00002.parquet")
    fewer = load_corpus(
        DataSource.parse(f"hf:{folder}", "content"), corpus.tokenizer_path, cache=tmp_path / "cache"
    )
    assert fewer.source_fingerprint != corpus.source_fingerprint  # a changed copy is another copy
    assert len(fewer.train_tokens) < len(corpus.train_tokens)


def test_bad_hf_input_is_one_line_naming_the_thing(tmp_path: Path) -> None:
    folder = tmp_path / "set"
    jsonl(folder / "train.jsonl", LINES[:50])
    (folder / "test.jsonl").write_text("")
    runner = CliRunner()
    train = ["train", "--steps", "1", "--data"]
    one_line_error(runner.invoke(main, [*train, f"hf:{tmp_path}/missing"]), "no dataset", "missing")
    one_line_error(runner.invoke(main, [*train, f"hf:{folder}"]), "no column 'text'", "it has body", "id")
    line = one_line_error(runner.invoke(main, [*train, f"hf:{folder}::test", "--text-column", "body"]))
    assert "split 'test' has no rows" in line
    line = one_line_error(runner.invoke(main, [*train, f"hf:{folder}::dev", "--text-column", "body"]))
    assert "no split 'dev'" in line and "train" in line
    one_line_error(runner.invoke(main, [*train, "hf:a:b:c:d"]), "hf:NAME[:CONFIG][:SPLIT]")
    one_line_error(runner.invoke(main, ["bootstrap", "--text-column", "body"]), "--text-column applies to")


def test_a_data_node_whose_data_is_not_the_runs_is_told_what_differs(tmp_path: Path) -> None:
    jsonl(tmp_path / "mine" / "d.jsonl", LINES[:1500])
    cache = tmp_path / "cache"
    corpus = load_corpus(DataSource.parse(str(tmp_path / "mine"), "body"), cache=cache)
    source = DataSource(
        "local", str(tmp_path / "mine"), text_column="body", fingerprint=corpus.source_fingerprint
    )
    check_run_data(corpus, source, corpus.tokenizer_digest, corpus.vocab_size)
    jsonl(tmp_path / "mine" / "d.jsonl", LINES[:1499])  # another copy at the same path
    changed = load_corpus(
        DataSource.parse(str(tmp_path / "mine"), "body"), corpus.tokenizer_path, cache=cache
    )
    with pytest.raises(
        DataError, match=r"this node's data .* is not the run's .*give this node the run's files"
    ):
        check_run_data(changed, source, corpus.tokenizer_digest, corpus.vocab_size)
    stdlib = load_corpus()
    other_python = DataSource(fingerprint="py3.10.4-0123456789abcdef")
    with pytest.raises(DataError, match=r"run this node with Python 3\.10\.4"):
        check_run_data(stdlib, other_python, stdlib.tokenizer_digest, stdlib.vocab_size)
    with pytest.raises(DataError, match=r"is not the run.s \(digest 0{16}\): data nodes must tokenise"):
        check_run_data(corpus, source, "0" * 16, corpus.vocab_size)


@pytest.mark.parametrize("asked", ["1", "0"])
def test_progress_bars_when_asked(
    tmp_path: Path, asked: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SWARMNODE_PROGRESS", asked)
    load_corpus(jsonl(tmp_path / "d.jsonl", LINES[:300], "text"), cache=tmp_path / "cache")
    err = capfd.readouterr().err
    shown = "training the tokenizer on" in err and "encoding" in err and "300" in err
    assert shown == (asked == "1"), err


def test_datasets_is_imported_only_for_hf_data(tmp_path: Path) -> None:
    data = jsonl(tmp_path / "d.jsonl", LINES[:400], "text")
    probe = f"""
import sys
from click.testing import CliRunner
from swarmnode.cli import main
from swarmnode.data import load_corpus
for command in ("train", "bootstrap", "join"):
    assert CliRunner().invoke(main, [command, "--help"]).exit_code == 0
from pathlib import Path
load_corpus({str(data)!r}, cache=Path({str(tmp_path / "cache")!r}))
print("datasets" in sys.modules)
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0 and done.stdout.split() == ["False"], done.stderr[-2000:]
