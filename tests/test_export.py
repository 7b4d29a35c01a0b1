"""`swarmnode export` on a real swarm: the exported folder loads in transformers and gives the swarm's loss.

A bootstrap, one lingering data node and one node per stage train the tiny preset for a few steps; the
exporter (a separate process) writes the folder, which transformers loads with no swarmnode code involved. An
exporter that lacks the run's tokenizer fetches it by the run's digest.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from swarm_harness import LocalTestSwarm, NodeProcess, poll, python_env

from swarmnode.data import load_corpus, validation_set
from swarmnode.exporter import run_tokenizer
from swarmnode.modeldir import load_pieces, read_model_folder
from swarmnode.pieces import build_piece
from swarmnode.runspec import RunSpec
from swarmnode.tokenizer import file_digest, train_tokenizer

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")


def hf_validation_loss(model, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:  # type: ignore[no-untyped-def]
    """Mean next-token cross-entropy of a transformers model over the batches (targets already shifted)."""
    with torch.no_grad():
        losses = [
            torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
            for x, y in batches
        ]
    return float(sum(losses) / len(losses))


@pytest.mark.timeout(240)
def test_export_round_trip_gives_the_swarms_logits_and_loss(swarm: LocalTestSwarm, tmp_path: Path) -> None:
    steps = 6
    swarm.bootstrap(steps=steps)
    stages = [swarm.join(k) for k in (1, 2, 3)]
    swarm.wait_online(*stages)
    data = swarm.join(0, "--linger")
    finished = data.wait_event("finished", 150)
    assert finished["step"] == steps

    out = tmp_path / "model"
    exporter = swarm.swarmnode(
        "export", "export", "--initial-peers", str(swarm.peers_file), "--run-id", swarm.run_id,
        "--out", str(out), "--evaluate",
    )  # fmt: skip
    assert exporter.wait_exit(120) == 0, exporter.stderr_tail()
    (exported,) = exporter.events("exported")
    assert exported["step"] == steps and set(exported["steps"]) == {"0", "1", "2", "3"}

    # the folder as transformers sees it: config, weights and tokenizer, no swarmnode involved
    assert {p.name for p in out.iterdir()} >= {
        "config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json",
    }  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    spec = RunSpec.for_preset("tiny", stages=3)
    corpus = load_corpus(None, None, spec.vocab_size)
    text = "def f(x):\n    return x"
    assert tokenizer(text)["input_ids"] == corpus.tokenizer.encode(text).ids
    assert json.loads((out / "config.json").read_text())["swarmnode"]["step"] == steps
    assert run_tokenizer(spec) == corpus.tokenizer_path

    # the same logits as the stage pieces loaded with the swarm's weights, and the swarm's own loss
    config, split = read_model_folder(out, 3)
    pieces = [build_piece(config, k, 3) for k in range(4)]
    load_pieces(pieces, split)
    batches = validation_set(corpus.val_tokens, spec.batch_size, spec.seq_len)
    inputs = batches[0][0]
    with torch.no_grad():
        hidden = pieces[0].embed(inputs)
        for stage in pieces[1:]:
            hidden = stage(hidden)
        ours = pieces[0].head(hidden)
        torch.testing.assert_close(hf(input_ids=inputs).logits, ours, atol=1e-5, rtol=0)
    swarm_loss = poll(lambda: data.events("validation")[-1]["val_loss"], 5, "the data node's last loss")
    assert hf_validation_loss(hf, batches) == pytest.approx(swarm_loss, abs=2e-4)
    assert exported["val_loss"] == pytest.approx(swarm_loss, abs=2e-4)


@pytest.mark.timeout(240)
def test_export_fetches_the_runs_tokenizer_it_lacks(swarm: LocalTestSwarm, tmp_path: Path) -> None:
    """A run with a tokenizer of its own (`bootstrap --tokenizer`, not the one trained on its data): an
    exporter given no --tokenizer, with an empty cache, fetches the run's file by digest and exports it."""
    text = "".join(f"def function_{i}(value):\n    return value * {i} + {i % 7}\n\n" for i in range(900))
    data = tmp_path / "code.txt"
    data.write_text(text)
    tokenizer = tmp_path / "custom.json"  # trained on other text than the run's data
    tokenizer.write_text(train_tokenizer([text.replace("value", "item").upper()], 300).to_str())
    swarm.bootstrap("--tokenizer", str(tokenizer), "--data", str(data), steps=2)
    stages = [swarm.join(k) for k in (1, 2, 3)]
    swarm.wait_online(*stages)
    swarm.join(0, "--linger", "--tokenizer", str(tokenizer)).wait_event("finished", 150)

    out, cache = tmp_path / "model", tmp_path / "empty-cache"
    argv = [swarm.python, "-m", "swarmnode", "export", "--initial-peers", str(swarm.peers_file)]
    argv += ["--run-id", swarm.run_id, "--out", str(out), "-v"]
    env = {**python_env(), "SWARMNODE_CACHE": str(cache)}
    exporter = NodeProcess("export", tuple(argv), swarm.folder, env)
    swarm.nodes.append(exporter)
    assert exporter.wait_exit(120) == 0, exporter.stderr_tail()
    assert (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    fetched = cache / "tokenizers" / f"{file_digest(tokenizer)}.json"
    assert fetched.read_bytes() == tokenizer.read_bytes()
    assert "fetched the run's tokenizer" in exporter.stderr_tail(200)
