"""A staged model trained in one process, forked, broken and rebuilt: what the CheckFree scripts share.

`StagedModel` holds the project's own pieces (`swarmnode.pieces.build_piece`: stage 0 = `E` and `E'`,
stages 1..s = `DecoderStage`s) and one `swarmnode.optim.StageOptimizer` per stage, as the reference trainer
does; a microbatch runs through them in stage order, or in CheckFree+ order where
`protocols.checkfree.swaps_edge_pairs` says so. Rebuilds go through `protocols.checkfree` (`plan_recovery`,
`average_neighbours`, `copy_partner`, `restore_embeddings`), with the evidence a CheckFree+ copy needs (the
swap partner's stand-ins) counted as stage nodes count it (`protocols.standins`), and the edge copies taken
when the script says (`refresh_edge_copies`). What the project lacks for an in-process study, and is built
here: forking a trained model with its optimizer state, and a batch stream that any fork can resume at any
step (batches are a function of (seed, step, microbatch)).
"""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from protocols.checkfree import (
    Method,
    Recovery,
    average_neighbours,
    copy_partner,
    plan_recovery,
    reinit_seed,
    restore_embeddings,
    swap_edge_pairs,
    swap_partner,
    swaps_edge_pairs,
)
from protocols.standins import StandIns, edge_places
from swarmnode.data import Corpus, batches, load_corpus, val_batches
from swarmnode.model_config import ModelConfig
from swarmnode.optim import Schedule, StageOptimizer
from swarmnode.pieces import DataPiece, build_piece
from swarmnode.presets import get_preset

EMBEDDING_PREFIX, HEAD_PREFIX = "embedding.", "head."


@dataclass(frozen=True)
class Setup:
    """The model and training settings of a study: the tiny preset's dimensions, `n_stages` stages of
    `n_layers / n_stages` layers, `microbatches` x `batch_size` sequences of `seq_len` per step, Adam at a
    constant `lr` after `warmup` steps (as the CheckFree paper trains; with `decay_steps` > 0, decayed
    along a cosine to a tenth of `lr` at that step, as the daemons and the trainer do), `val_batches` fixed
    validation batches of `batch_size`."""

    n_stages: int = 6
    n_layers: int = 6
    seq_len: int = 128
    batch_size: int = 4
    microbatches: int = 1
    lr: float = 3e-3
    warmup: int = 10
    val_batches: int = 4
    swap_every: int = 2  # CheckFree+ swaps one microbatch in this many (`swaps_edge_pairs`)
    decay_steps: int = 0  # 0: constant lr after the warm-up; else cosine to 0.1 lr at this step

    def model_config(self, vocab_size: int) -> ModelConfig:
        tiny = get_preset("tiny").model
        return replace(tiny, vocab_size=vocab_size, n_layers=self.n_layers, max_seq_len=self.seq_len)

    def schedule(self) -> Schedule:
        if self.decay_steps > 0:
            return Schedule(self.lr, self.warmup, total_steps=self.decay_steps)
        return Schedule(self.lr, self.warmup, total_steps=max(1, self.warmup), min_ratio=1.0)


class Data:
    """The corpus, fixed validation batches, and training batches addressed by (seed, step, microbatch)."""

    def __init__(self, setup: Setup, corpus: Corpus | None = None) -> None:
        self.setup = setup
        self.corpus = corpus or load_corpus(None, None, get_preset("tiny").vocab_size)
        self.val = val_batches(self.corpus.val_tokens, setup.batch_size, setup.seq_len, setup.val_batches)

    def batch(self, seed: int, step: int, microbatch: int) -> tuple[Tensor, Tensor]:
        if min(seed, step, microbatch) < 0:
            raise ValueError(f"negative batch address ({seed}, {step}, {microbatch})")
        address = (seed * 1_000_003 + step) * 64 + microbatch
        stream = batches(self.corpus.train_tokens, self.setup.batch_size, self.setup.seq_len, seed=address)
        return next(stream)


class StagedModel:
    """`E, S1..Ss, E'` with one optimizer per stage; `pieces[0]` is the data stage, `pieces[k]` stage k."""

    def __init__(self, setup: Setup, vocab_size: int, seed: int) -> None:
        self.setup, self.seed = setup, seed
        self.config = setup.model_config(vocab_size)
        torch.manual_seed(seed)
        n = setup.n_stages
        self.pieces = [build_piece(self.config, k, n, seed=seed) for k in range(n + 1)]
        self.optimizers = [StageOptimizer(piece, setup.schedule()) for piece in self.pieces]
        self.step = 0  # optimizer steps taken by the whole model (the batch address)
        self.copies: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None  # CheckFree+ E, E'
        self.edge_copies: dict[int, dict[str, Tensor]] = {}  # edge stage -> the copy its partner keeps
        # iterations in which stage 2 ran in stage 1's place (`first`) and stage s-1 in stage s's (`last`)
        self.stand_ins = StandIns()

    @property
    def n_stages(self) -> int:
        return self.setup.n_stages

    def fork(self) -> StagedModel:
        """An independent copy: weights, Adam moments, step counts, lr factors, gradient norms, copies."""
        return copy.deepcopy(self)

    def order(self, swapped: bool) -> list[int]:
        """The transformer stages in the order a microbatch visits them."""
        stages = tuple(range(1, self.n_stages + 1))
        return [stages[i] for i in swap_edge_pairs(stages, self.n_stages)] if swapped else list(stages)

    def _hidden(self, inputs: Tensor, order: list[int]) -> Tensor:
        data = self._data_piece()
        hidden = data.embed(inputs)
        for k in order:
            hidden = self.pieces[k](hidden)
        return hidden

    def train_step(self, data: Data, checkfree_plus: bool = False) -> float:
        """One iteration: the step's microbatches (CheckFree+ order where the protocol swaps), gradients
        weighted 1 / microbatches, one optimizer step per stage. Returns the mean training loss."""
        n = self.setup.microbatches
        total = 0.0
        for m in range(n):
            inputs, targets = data.batch(self.seed, self.step, m)
            swapped = checkfree_plus and swaps_edge_pairs(self.n_stages, self.step, m, self.setup.swap_every)
            order = self.order(swapped)
            self._count_stand_ins(order)
            loss = self._data_piece().loss(self._hidden(inputs, order), targets)
            (loss / n).backward()
            total += float(loss.detach()) / n
        for optimizer in self.optimizers:
            optimizer.step()
        self.step += 1
        if not math.isfinite(total):
            raise FloatingPointError(f"training loss became {total} at step {self.step}")
        return total

    def _count_stand_ins(self, order: list[int]) -> None:
        """Note where a microbatch visiting `order` had the swap partners serve in the edge stages' places."""
        path = (0, *order, 0)
        for hop in range(1, len(path) - 1):
            places = edge_places(path, hop, self.n_stages)
            if any(places):
                self.stand_ins = self.stand_ins.add(self.step, places, self.step)

    def evaluate(self, data: Data) -> float:
        """Mean validation loss over the fixed batches, stages in their own order."""
        order = self.order(False)
        with torch.no_grad():
            losses = [float(self._data_piece().loss(self._hidden(x, order), y)) for x, y in data.val]
        return sum(losses) / len(losses)

    def redundant_forward(self, data: Data) -> None:
        """The extra work of redundant computation (Bamboo-style) in one iteration: every stage also runs its
        successor's forward on its own output, without gradients (used only to time an iteration)."""
        inputs, _ = data.batch(self.seed, self.step, 0)
        with torch.no_grad():
            hidden = self._data_piece().embed(inputs)
            for k in range(1, self.n_stages + 1):
                hidden = self.pieces[k](hidden)
                if k < self.n_stages:
                    self.pieces[k + 1](hidden)

    def state(self, k: int) -> dict[str, Tensor]:
        """Stage k's weights, detached copies (what a donor would send)."""
        return {name: t.detach().clone() for name, t in self.pieces[k].state_dict().items()}

    def grad_norm(self, k: int) -> float | None:
        """Stage k's gradient norm at its last optimizer step, before clipping."""
        return self.optimizers[k].last_grad_norm

    def refresh_copies(self) -> None:
        """CheckFree+: stage-1 nodes take a copy of `E`, stage-s nodes a copy of `E'`."""
        data = self._data_piece()
        embedding = {EMBEDDING_PREFIX + n: t.detach().clone() for n, t in data.embedding.state_dict().items()}
        head = {HEAD_PREFIX + n: t.detach().clone() for n, t in data.head.state_dict().items()}
        self.copies = (embedding, head)

    def refresh_edge_copies(self) -> None:
        """Edge copies: stage-2 nodes take a copy of stage 1's weights, stage-(s-1) nodes one of stage s's."""
        self.edge_copies = {k: self.state(k) for k in {1, self.n_stages} if swap_partner(k, self.n_stages)}

    def reinit_weights(self, k: int) -> dict[str, Tensor]:
        """Fresh weights for stage k, as a re-initialised node draws them (`reinit_seed` of the run seed,
        the stage and the step: not the run's step-0 weights)."""
        seed = reinit_seed(self.seed, k, self.step)
        return build_piece(self.config, k, self.n_stages, seed=seed).state_dict()

    def plan(self, stage: int, lost: set[int], checkfree_plus: bool) -> Recovery:
        """`protocols.checkfree.plan_recovery` for `stage` when the stages in `lost` are gone, with the
        copies of E and E' held exactly when CheckFree+ took them, and the swap partners' stand-ins over the
        recent window (at the clock a stage node reports them: the steps taken)."""
        held = checkfree_plus and self.copies is not None
        edge_held = set(self.edge_copies) if checkfree_plus else set()
        first, last = self.stand_ins.recent(self.step)
        return plan_recovery(
            stage,
            num_stages=self.n_stages,
            alive=set(range(self.n_stages + 1)) - lost,
            checkfree_plus=checkfree_plus,
            stood_in={1: first, self.n_stages: last} if self.n_stages > 1 else {},
            embedding_copy_held=held,
            head_copy_held=held,
            edge_copies_held=edge_held,
        )

    def install(self, k: int, weights: Mapping[str, Tensor], lr_factor: float) -> None:
        """Stage k takes `weights` and starts a fresh Adam at `lr_factor` (its schedule position stays); a
        rebuilt swap partner has not yet stood in for its edge stage, nor does it keep its edge copy."""
        self.pieces[k].load_state_dict(dict(weights), strict=True)
        self.edge_copies = {e: c for e, c in self.edge_copies.items() if swap_partner(e, self.n_stages) != k}
        if k == 2:
            self.stand_ins = replace(self.stand_ins, first=())
        if k == self.n_stages - 1:
            self.stand_ins = replace(self.stand_ins, last=())
        self.optimizers[k].reset(lr_factor)
        self.optimizers[k].last_grad_norm = None

    def rebuild(self, recovery: Recovery) -> None:
        """Carry out a `protocols.checkfree` plan on this model, reading its sources as they are now."""
        k, src = recovery.stage, recovery.sources
        if recovery.method is Method.CHECKFREE and len(src) == 2:
            weights = average_neighbours(self.state(src[0]), self.state(src[1]), *map(self.grad_norm, src))
        elif recovery.method in (Method.CHECKFREE, Method.CHECKFREE_PLUS_COPY):  # one source: a copy
            weights = copy_partner(self.state(src[0]))
        elif recovery.method is Method.EDGE_COPY:
            weights = copy_partner(self.edge_copies[k])
        elif recovery.method is Method.EMBEDDING_COPY:
            if self.copies is None:
                raise ValueError("stage 0 planned from copies that were never taken")
            weights = restore_embeddings(*self.copies)
        elif recovery.method is Method.REINIT:
            weights = self.reinit_weights(k)
        else:
            raise ValueError(f"{recovery.method} is not a rebuild (a live replica would be copied)")
        self.install(k, weights, recovery.lr_factor)

    def _data_piece(self) -> DataPiece:
        piece = self.pieces[0]
        if not isinstance(piece, DataPiece):
            raise TypeError("stage 0 must be the data piece")
        return piece


def steps_to_regain(curve: list[tuple[int, float]], target: float, cap: int) -> int:
    """The first evaluated step (after the failure) whose loss is at most `target`, else `cap`."""
    return next((step for step, loss in curve if loss <= target), cap)


def common_args(description: str) -> argparse.ArgumentParser:
    """The options every CheckFree reproduction script takes."""
    parser = argparse.ArgumentParser(description=description)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the short run (minutes on 2 cores)")
    mode.add_argument("--smoke", action="store_true", help="seconds: a few steps, for the tests only")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (default: the mode's)")
    parser.add_argument("--json", type=str, default=None, help="write the result here")
    parser.add_argument("--plot", type=str, default=None, help="write the figure here (PNG)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--rescore", type=str, default=None, help="recompute rows and verdict of this result")
    return parser


def mode_name(args: argparse.Namespace) -> str:
    return "smoke" if args.smoke else "quick" if args.quick else "full"


def mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def mean_curve(curves: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """The mean over seeds of validation curves evaluated at the same steps."""
    steps = [step for step, _ in curves[0]]
    if any([step for step, _ in c] != steps for c in curves):
        raise ValueError("curves of different seeds were evaluated at different steps")
    return [(step, mean([c[i][1] for c in curves])) for i, step in enumerate(steps)]


def plot_curves(path: str, title: str, panels: list[tuple[str, dict[str, list[tuple[int, float]]]]]) -> None:
    """One panel per group: validation loss after the failure (mean over seeds) for each method."""
    from matplotlib.figure import Figure  # Agg, whatever the default backend

    fig = Figure(figsize=(4.6 * len(panels), 3.6), layout="constrained")
    for ax, (name, curves) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        for label, curve in curves.items():
            style = "k--" if label.startswith("no_failure") else "-"
            ax.plot([s for s, _ in curve], [v for _, v in curve], style, label=label, linewidth=1.2)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("steps after the failure")
        ax.set_ylabel("validation loss (mean over seeds)")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
