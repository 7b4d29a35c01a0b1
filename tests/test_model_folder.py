"""Hugging Face model folders (`swarmnode.modeldir`): `train --out` writes one that transformers loads,
`train --init-from` continues from it at its loss, and bad `--out` / `--init-from` values are one-line usage
errors naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import one_line_usage_error, run

from swarmnode.data import load_corpus
from swarmnode.hf import SplitStateDicts
from swarmnode.model import Llama
from swarmnode.modeldir import ModelFolderError, check_out_folder, read_model_folder, write_model_folder
from swarmnode.presets import get_preset


def test_a_written_folder_loads_in_transformers_with_the_same_logits(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = get_preset("tiny").model
    model = Llama(config, n_stages=3, seed=1)
    pieces = SplitStateDicts(
        model.embedding.state_dict(), [s.state_dict() for s in model.stages], model.head.state_dict()
    )
    corpus = load_corpus(None, None, config.vocab_size)
    out = tmp_path / "model"
    for _ in range(2):  # the second write replaces the first whole
        write_model_folder(out, config, pieces, corpus.tokenizer_path, {"step": 7})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer("import os\nprint(os.sep)")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, model(ids), atol=1e-5, rtol=0)
    assert tokenizer.eos_token == "<|endoftext|>" and hf.generation_config.eos_token_id == corpus.eos_id
    read_config, split = read_model_folder(out, n_stages=2)  # a folder does not fix how it is cut
    assert read_config == config and len(split.stages) == 2


def test_train_out_then_init_from_continues_at_the_exported_loss(
    trained: tuple[Path, dict[str, float]],
) -> None:
    out, first = trained
    assert json.loads((out / "config.json").read_text())["swarmnode"]["step"] == first["steps"]
    code, output = run("train", "--steps", "1", "--eval-every", "1", "--init-from", str(out), "--json")
    assert code == 0, output
    second = json.loads(output.strip().splitlines()[-1])
    assert second["initial_val_loss"] == pytest.approx(first["val_loss"], abs=1e-6)


def test_bad_out_is_a_one_line_usage_error(tmp_path: Path) -> None:
    afile = tmp_path / "file"
    afile.write_text("x")
    one_line_usage_error(*run("train", "--steps", "1", "--out", str(afile)), "--out", "is a file")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    one_line_usage_error(*run("train", "--steps", "1", "--out", str(tmp_path / "other")), "notes.txt")
    with pytest.raises(ModelFolderError, match="snapshots"):
        check_out_folder(tmp_path / "other", snapshots="step-")


def test_bad_init_from_is_a_one_line_usage_error_naming_the_field(
    trained: tuple[Path, dict[str, float]], tmp_path: Path
) -> None:
    out, _ = trained
    one_line_usage_error(*run("train", "--init-from", str(tmp_path / "none")), "--init-from", "not a folder")
    for field, value in (("hidden_size", 64), ("vocab_size", 5000), ("num_hidden_layers", 3)):
        changed = tmp_path / field
        changed.mkdir()
        for path in out.iterdir():
            (changed / path.name).write_bytes(path.read_bytes())
        raw = json.loads((changed / "config.json").read_text())
        (changed / "config.json").write_text(json.dumps({**raw, field: value}))
        code, output = run("train", "--steps", "1", "--init-from", str(changed))
        one_line_usage_error(code, output, "--init-from", f"{field} is {value} in the folder")
    (changed / "model.safetensors").write_bytes(b"not safetensors")
    (changed / "config.json").write_text((out / "config.json").read_text())
    one_line_usage_error(*run("train", "--steps", "1", "--init-from", str(changed)), "model.safetensors")


def test_rolling_snapshots_keep_the_newest(tmp_path: Path) -> None:
    from swarmnode.exporter import prune

    for step in (10, 20, 30, 40):
        (tmp_path / f"step-{step:06d}").mkdir()
    (tmp_path / ".step-000050.abc.partial").mkdir()  # a snapshot being written is not counted
    prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".step-000050.abc.partial",
        "step-000030",
        "step-000040",
    ]
    check_out_folder(tmp_path, snapshots="step-")  # a folder of snapshots takes more
