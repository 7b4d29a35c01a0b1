"""`bootstrap --init-from DIR`: a run that starts from a model folder. The bootstrap serves each stage's
initial weights, the run definition carries their digests, every node of a fresh run loads its stage's
weights from the bootstrap, and the swarm's first validation loss is the folder's."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from cli_helpers import one_line_usage_error, run
from hivemind.p2p import PeerID
from swarm_harness import LocalTestSwarm

from protocols.messages import Error, ErrorCode, decode, encode
from protocols.transfers import StatePart, StateRequest, StateTransfer
from swarmnode.node import state
from swarmnode.node.seed import SeedServer, SeedWeights, digest, read_seed
from swarmnode.runspec import RunSpec, RunSpecError
from swarmnode.transport import Reply

Trained = tuple[Path, dict[str, float]]
PEER = PeerID.from_base58("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")


def test_seed_digests_name_each_stage_and_change_with_any_weight(
    trained: tuple[Path, dict[str, float]],
) -> None:
    folder, _ = trained
    spec = RunSpec.for_preset("tiny", vocab_size=4096)
    seed = read_seed(folder, spec)
    assert len(seed.stages) == spec.stages + 1 and len(set(seed.digests)) == spec.stages + 1
    assert read_seed(folder, spec).digests == seed.digests  # a pure function of the folder
    changed = dict(seed.stages[2])
    name = next(iter(changed))
    changed[name] = changed[name].clone()
    changed[name].view(-1)[0] += 1e-6
    assert digest(changed) != seed.digests[2]
    RunSpec.for_preset("tiny", init_digests=",".join(seed.digests))
    for bad in ("abc", ",".join(seed.digests[:-1]), ",".join(d.upper() for d in seed.digests)):
        with pytest.raises(RunSpecError, match="init_digests"):
            RunSpec.for_preset("tiny", init_digests=bad)


def test_the_seed_server_sends_weights_and_refuses_everything_else() -> None:
    spec = RunSpec(run_id="r", stages=3)
    seed = SeedWeights(tuple({"w": torch.full((2, 3), float(k))} for k in range(4)))
    server = SeedServer(spec, seed)

    def ask(request: StateRequest | bytes) -> tuple[bytes, list[torch.Tensor]] | Reply:
        meta = request if isinstance(request, bytes) else encode(request)
        return asyncio.run(server.serve(PEER, meta, []))

    reply = ask(StateRequest("r", 2, (StatePart.WEIGHTS,)))
    assert isinstance(reply, Reply)
    header = decode(reply.meta)
    assert isinstance(header, StateTransfer) and (header.stage, header.step) == (2, 0)
    assert digest(state.unpack(header.tensors, reply.tensors)) == seed.digests[2]
    for request, code in (
        (StateRequest("other", 1, (StatePart.WEIGHTS,)), ErrorCode.WRONG_RUN),
        (StateRequest("r", 4, (StatePart.WEIGHTS,)), ErrorCode.WRONG_STAGE),
        (StateRequest("r", 1, (StatePart.WEIGHTS, StatePart.OPTIMIZER)), ErrorCode.WRONG_STAGE),
        (b"\x93\xa5bogus", ErrorCode.MALFORMED),
    ):
        answer = ask(request)
        assert not isinstance(answer, Reply)
        error = decode(answer[0])
        assert isinstance(error, Error) and error.code == code, error
    busy = [ask(StateRequest("r", 1, (StatePart.WEIGHTS,))) for _ in range(3)]  # 4 held (none written yet)
    answer = ask(StateRequest("r", 1, (StatePart.WEIGHTS,)))
    assert not isinstance(answer, Reply) and decode(answer[0]).code == ErrorCode.BUSY
    for held in (reply, *busy):
        assert isinstance(held, Reply) and held.written is not None
        held.written(True)
    assert isinstance(ask(StateRequest("r", 1, (StatePart.WEIGHTS,))), Reply)


def test_bad_init_from_is_a_one_line_usage_error(
    trained: tuple[Path, dict[str, float]], tmp_path: Path
) -> None:
    folder, _ = trained
    one_line_usage_error(
        *run("bootstrap", "--init-from", str(tmp_path / "none")), "--init-from", "not a folder"
    )
    changed = tmp_path / "changed"
    changed.mkdir()
    for path in folder.iterdir():
        (changed / path.name).write_bytes(path.read_bytes())
    raw = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**raw, "vocab_size": 5000}))
    one_line_usage_error(*run("bootstrap", "--init-from", str(changed)), "--init-from", "vocab_size is 5000")
    (changed / "config.json").write_text(json.dumps(raw))
    (changed / "tokenizer.json").write_text('{"other": "tokenizer"}')
    one_line_usage_error(
        *run("bootstrap", "--init-from", str(changed)), "--init-from", "not the run's tokenizer"
    )


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_run_started_from_a_folder_begins_at_its_loss(swarm: LocalTestSwarm, trained: Trained) -> None:
    folder, figures = trained
    swarm.bootstrap("--init-from", str(folder), steps=3)
    stages = [swarm.join(k) for k in (1, 2, 3)]
    swarm.wait_online(*stages)
    data = swarm.join(0)
    finished = data.wait_event("finished", 180)
    assert data.wait_exit(30) == 0 and finished["step"] == 3
    for node in (data, *stages):
        assert len(node.events("seeded")) == 1, node.stderr_tail()
    first = data.events("validation")[0]
    assert first["step"] == 0
    assert first["val_loss"] == pytest.approx(figures["val_loss"], rel=1e-4)
