"""The CheckFree reproduction scripts (benchmarks/repro/checkfree_*.py, failure_wallclock.py): each runs in
smoke mode as a subprocess and writes a result of the agreed shape with real numbers; the shared helper
forks, reorders and rebuilds a staged model as the protocol says."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPRO = Path(__file__).resolve().parents[1] / "benchmarks" / "repro"
VERDICTS = ("reproduced", "in shape", "not reproduced")


def run_smoke(script: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{script}.json"
    png = tmp_path / f"{script}.png"
    proc = subprocess.run(
        [sys.executable, str(REPRO / f"{script}.py"), "--smoke", "--json", str(out), "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard: a smoke run takes seconds of CPU, minutes on a loaded machine
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert png.stat().st_size > 1000
    body = json.loads(out.read_text())
    assert body["claim"] and body["verdict"].startswith(VERDICTS)
    assert body["mode"] == "smoke"
    assert body["cpu_seconds"] > 0  # the run's CPU time, what its idle-machine time is estimated from
    return body


def staged() -> tuple[type, type, type]:
    """`benchmarks/repro/_staged.py`'s Data, Setup and StagedModel (the scripts' in-process model)."""
    sys.path.insert(0, str(REPRO))
    try:
        from _staged import Data, Setup, StagedModel
    finally:
        sys.path.remove(str(REPRO))
    return Data, Setup, StagedModel


def rows_by(body: dict) -> dict[tuple[str, str], list[float]]:
    rows = {(r["method"], r["metric"]): r["seeds"] for r in body["rows"]}
    assert len(rows) == len(body["rows"]), "a (method, metric) pair appears twice"
    return rows


def test_ablation_smoke(tmp_path: Path) -> None:
    body = run_smoke("checkfree_ablation", tmp_path)
    rows = rows_by(body)
    assert {len(v) for v in rows.values()} == {2}
    assert {m for m, _ in rows} >= {"no_failure", "reinit", "copy", "average", "checkfree"}
    pre = rows[("pre_failure", "val loss at the snapshot")]
    # the control is the snapshot itself; every rebuild changes the model
    assert rows[("no_failure", "val loss just after rebuild")] == pre
    for method in ("reinit", "copy", "average", "checkfree"):
        after = rows[(method, "val loss just after rebuild")]
        assert all(math.isfinite(v) for v in after) and after != pre
    for run in body["runs"]:
        norms = run["grad_norms"]
        assert norms["previous"] > 0 and norms["following"] > 0


def test_checkfree_plus_smoke(tmp_path: Path) -> None:
    body = run_smoke("checkfree_plus", tmp_path)
    rows = rows_by(body)
    assert {len(v) for v in rows.values()} == {2}
    after = "val loss just after the loss"
    for run in body["runs"]:
        used = run["methods_used"]
        assert used["S1 copy (swaps)"] == "checkfree_plus_copy"
        assert used["E restore (swaps)"] == "embedding_copy"
        assert used["S1 reinit (swaps)"] == used["E reinit (swaps)"] == "reinit"
    # a restore from copies one step stale lands next to the control; fresh embeddings do not
    control = rows[("no_failure (swaps)", after)]
    restore, reinit = rows[("E restore (swaps)", after)], rows[("E reinit (swaps)", after)]
    for c, good, bad in zip(control, restore, reinit, strict=True):
        assert abs(good - c) < abs(bad - c)
    assert body["copies_bytes"] > 0


def test_failure_wallclock_smoke(tmp_path: Path) -> None:
    body = run_smoke("failure_wallclock", tmp_path)
    rows = rows_by(body)
    assert {len(v) for v in rows.values()} == {1}
    seed = body["seeds"][0]
    assert seed["redundant_ratio"] > 1.0 and math.isfinite(seed["target"])
    for label in body["rates"]:
        no_failure = rows[(f"no_failure @{label}", "iterations to target, paper J=0.33")][0]
        assert 0 < no_failure <= body["target_steps"]
        redundant = rows[(f"redundant @{label}", "iterations to target, paper J=0.33")][0]
        assert redundant == pytest.approx(no_failure * seed["redundant_ratio"])
    top = list(body["rates"])[-1]
    runs = seed["runs"][top]
    # the same draws for every method: at the highest rate each one met failures and handled them its way
    assert runs["checkpointing"]["events"] > 0 and runs["checkpointing"]["saves"] > 0
    assert runs["checkfree"]["stages_lost"] > 0 and sum(runs["checkfree"]["methods"].values()) > 0
    assert runs["checkfree_plus"]["refreshes"] >= 0


def test_staged_model_forks_swaps_and_rebuilds() -> None:
    Data, Setup, StagedModel = staged()
    from protocols.checkfree import Method

    setup = Setup(seq_len=16, val_batches=1)
    data = Data(setup)
    model = StagedModel(setup, data.corpus.vocab_size, seed=3)
    assert model.order(True) == [2, 1, 3, 4, 6, 5] and model.order(False) == [1, 2, 3, 4, 5, 6]
    model.train_step(data)
    model.train_step(data, checkfree_plus=True)
    fork = model.fork()
    fork.train_step(data)
    assert not torch.equal(
        fork.state(2)["layers.0.mlp.up_proj.weight"], model.state(2)["layers.0.mlp.up_proj.weight"]
    )

    plan = model.plan(3, {3}, checkfree_plus=False)
    assert plan.method is Method.CHECKFREE and plan.sources == (2, 4)
    w2, w4 = model.grad_norm(2), model.grad_norm(4)
    expected = {k: (w2 * v + w4 * model.state(4)[k]) / (w2 + w4) for k, v in model.state(2).items()}
    model.rebuild(plan)
    for name, value in model.state(3).items():
        torch.testing.assert_close(value, expected[name])
    assert model.optimizers[3].lr_factor == pytest.approx(1.1) and not model.optimizers[3].adam.state

    model.refresh_copies()
    restored = model.plan(0, {0}, checkfree_plus=True)
    assert restored.method is Method.EMBEDDING_COPY
    before = {k: v.clone() for k, v in model.pieces[0].state_dict().items()}
    model.install(0, model.reinit_weights(0), 1.0)
    model.rebuild(restored)
    for name, value in model.pieces[0].state_dict().items():
        torch.testing.assert_close(value, before[name])


def test_staged_setup_keeps_the_paper_constant_rate_or_decays_as_the_daemons_do() -> None:
    _, Setup, _ = staged()
    constant = Setup(lr=1e-3, warmup=10).schedule()
    assert [constant.lr_at(step) for step in (9, 10, 150, 10**6)] == pytest.approx([1e-3] * 4)
    cosine = Setup(lr=1e-3, warmup=10, decay_steps=150).schedule()
    assert cosine.lr_at(9) == pytest.approx(1e-3)
    assert 1e-4 < cosine.lr_at(80) < 1e-3
    assert [cosine.lr_at(step) for step in (150, 175)] == pytest.approx([1e-4, 1e-4])


def test_staged_model_plans_a_partner_copy_only_after_its_stand_ins() -> None:
    Data, Setup, StagedModel = staged()
    from protocols.checkfree import Method
    from protocols.standins import MIN_STAND_INS

    setup = Setup(seq_len=16, val_batches=1)
    data = Data(setup)
    model = StagedModel(setup, data.corpus.vocab_size, seed=1)
    for _ in range(2 * MIN_STAND_INS - 1):  # swaps on odd steps: one stand-in short
        model.train_step(data, checkfree_plus=True)
    assert model.stand_ins.recent(model.step) == (MIN_STAND_INS - 1, MIN_STAND_INS - 1)
    assert model.plan(1, {1}, checkfree_plus=True).method is Method.CHECKFREE  # the neighbour's copy
    model.train_step(data, checkfree_plus=True)
    assert model.plan(1, {1}, checkfree_plus=True).method is Method.CHECKFREE_PLUS_COPY
    assert model.plan(6, {6}, checkfree_plus=True).method is Method.CHECKFREE_PLUS_COPY
    model.install(5, model.reinit_weights(5), 1.0)  # a rebuilt partner has stood in for nothing yet
    assert model.plan(6, {6}, checkfree_plus=True).method is Method.CHECKFREE
    assert model.plan(1, {1}, checkfree_plus=True).method is Method.CHECKFREE_PLUS_COPY
    plain = StagedModel(setup, data.corpus.vocab_size, seed=1)
    for _ in range(2 * MIN_STAND_INS):
        plain.train_step(data)
    assert plain.stand_ins.recent(plain.step) == (0, 0)


def test_staged_model_restores_an_edge_stage_from_the_copy_its_partner_keeps() -> None:
    Data, Setup, StagedModel = staged()
    from protocols.checkfree import Method

    setup = Setup(seq_len=16, val_batches=1)
    data = Data(setup)
    model = StagedModel(setup, data.corpus.vocab_size, seed=2)
    model.train_step(data)
    model.refresh_edge_copies()
    taken = model.state(1)
    model.train_step(data)  # the copy is one step old now
    assert model.plan(1, {1}, checkfree_plus=False).method is Method.CHECKFREE  # copies are CheckFree+'s
    plan = model.plan(1, {1}, checkfree_plus=True)
    assert (plan.method, plan.sources, plan.lr_factor) == (Method.EDGE_COPY, (2,), 1.0)
    model.rebuild(plan)
    for name, value in model.state(1).items():
        assert torch.equal(value, taken[name]), name
    assert not model.optimizers[1].adam.state
    model.install(5, model.reinit_weights(5), 1.0)  # a rebuilt partner lost the copy it kept
    assert model.plan(6, {6}, checkfree_plus=True).method is Method.CHECKFREE
    assert model.plan(1, {1}, checkfree_plus=True).method is Method.EDGE_COPY
