"""`swarmnode export`: read every stage's weights from live nodes of a run and write a Hugging Face folder.

The exporter is a DHT client of the run. It announces itself with an `exporting` record under stage 0
(republished every record period), which `protocols.access` lets read the `weights` of every stage and
nothing else, and asks one online node of every stage, all stages at once, for its weights (the state
transfer a joiner uses; a busy donor is asked again, a failing one replaced by another replica). The data
node's weights hold `E` and `E'`.

Consistency: each stage gives its latest state, fetched at the same moment; the step each came from is kept
in `config.json` (`swarmnode.steps`), so the spread is visible. Stages step within one tick of the swarm
clock of each other, and at the end of a run (data nodes started with `join --linger` stay online) every
stage has taken the last step. With `every_steps`, a snapshot `step-NNNNNN` is written each time the swarm
clock passes another multiple, the `keep` newest are kept, and the last step of the run is always exported.
"""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from protocols.errors import ProtocolError
from protocols.messages import NodeRecord, NodeState
from protocols.transfers import StatePart
from swarmnode.data import Corpus, load_corpus, validation_set
from swarmnode.datasource import cache_dir, default_source, user_source
from swarmnode.dht import SwarmDHT
from swarmnode.hf import SplitStateDicts
from swarmnode.model import DecoderStage, OutputHead, TokenEmbedding
from swarmnode.model_config import ModelConfig, stage_layers
from swarmnode.modeldir import load_pieces, read_model_folder, write_model_folder
from swarmnode.node import state
from swarmnode.node.events import emit
from swarmnode.node.planning import SwarmRead
from swarmnode.node.recovery import DonorBusy, request_state
from swarmnode.node.serving import STATE_SECONDS
from swarmnode.pieces import DataPiece, build_piece
from swarmnode.presets import get_preset
from swarmnode.runspec import RunSpec
from swarmnode.tokenizer import cached_tokenizer, file_digest, load_tokenizer
from swarmnode.tokenizer_fetch import obtain_tokenizer
from swarmnode.trainer import evaluate
from swarmnode.transport import Transport, TransportError

T = TypeVar("T")

logger = logging.getLogger(__name__)

FETCH_WAIT_S = STATE_SECONDS  # how long every stage gets to provide its weights (busy donors, a lost stage)
RETRY_S = 0.5
SNAPSHOT_PREFIX = "step-"


class ExportError(RuntimeError):
    """The model could not be read from the swarm."""


@dataclass(frozen=True)
class FetchedModel:
    pieces: SplitStateDicts
    steps: dict[int, int]  # stage -> the step of the state its weights came from


def model_config(spec: RunSpec) -> ModelConfig:
    return replace(get_preset(spec.preset).model, vocab_size=spec.vocab_size)


def run_tokenizer(spec: RunSpec) -> Path:
    """The tokenizer the data nodes of a run that names none by digest use: trained on the run's data (and
    cached), the same file on every machine with the same data."""
    source = default_source() if spec.data is None else user_source(Path(spec.data))
    return cached_tokenizer(source, spec.vocab_size, cache_dir())


class Exporter:
    """Reads the model of one run from its live nodes; `announce` must run while it does."""

    def __init__(self, dht: SwarmDHT, spec: RunSpec, transport: Transport) -> None:
        self.dht, self.spec, self.transport = dht, spec, transport
        self.config = model_config(spec)
        self.rng = random.Random()
        self.view = SwarmRead({})

    async def announce(self) -> None:
        """Keep an `exporting` record on the DHT (the donors serve weights only to peers with one)."""
        while True:
            await asyncio.sleep(self.spec.record_period_s)
            try:
                await self.publish()
            except TimeoutError:
                logger.warning("the DHT did not store the exporter's record in time")

    async def publish(self) -> None:
        await self.dht.publish(NodeRecord(NodeState.EXPORTING, 0, 0, 0), self.spec.record_ttl_s)

    async def refresh(self) -> SwarmRead:
        self.view = SwarmRead(await self.dht.read_swarm(self.spec.stages))
        return self.view

    async def fetch_model(self) -> FetchedModel:
        """Every stage's weights (stage 0: E and E'), all asked for at once."""
        await self.refresh()
        fetched = await asyncio.gather(*(self._fetch_stage(k) for k in range(self.spec.stages + 1)))
        data, *stages = (tensors for _, tensors in fetched)
        pieces = SplitStateDicts(
            state.split_piece_copy(data, StatePart.EMBEDDING_COPY),
            stages,
            state.split_piece_copy(data, StatePart.HEAD_COPY),
        )
        return FetchedModel(pieces, {k: step for k, (step, _) in enumerate(fetched)})

    async def _fetch_stage(self, stage: int) -> tuple[int, state.TensorMap]:
        reference = _layout(self.config, stage, self.spec.stages)
        deadline = time.monotonic() + FETCH_WAIT_S
        while True:
            donors = self.view.online(stage)
            self.rng.shuffle(donors)
            for donor in donors:
                try:
                    parts = (StatePart.WEIGHTS,)
                    header, tensors = await request_state(
                        self.transport, self.spec.run_id, donor, stage, parts, STATE_SECONDS
                    )
                    state.check_layout(reference, tensors, f"weights of stage {stage} from {donor[-8:]}")
                    return header.step, tensors
                except (TransportError, ProtocolError, state.StateMismatch, DonorBusy) as error:
                    logger.info("weights of stage %d from %s: %s", stage, donor[-8:], error)
            if time.monotonic() >= deadline:
                why = "no online node" if not donors else f"none of its {len(donors)} online node(s) answered"
                raise ExportError(f"stage {stage}: {why} provided its weights within {FETCH_WAIT_S:g} s")
            await asyncio.sleep(RETRY_S)
            await self.refresh()

    async def export(self, out: Path, tokenizer: Path) -> dict[str, Any]:
        """Fetch the model and write it to `out`; returns the metadata written with it."""
        fetched = await self.fetch_model()
        metadata = {
            "run_id": self.spec.run_id,
            "preset": self.spec.preset,
            "stages": self.spec.stages,
            "step": fetched.steps[0],
            "steps": {str(k): step for k, step in fetched.steps.items()},
            "exported_at": round(time.time(), 3),
        }
        await asyncio.to_thread(write_model_folder, out, self.config, fetched.pieces, tokenizer, metadata)
        return metadata

    async def export_every(
        self,
        out: Path,
        tokenizer: Path,
        every: int,
        keep: int,
        written: Callable[[Path, dict[str, Any]], Any],
    ) -> None:
        """Snapshots `out/step-NNNNNN` each time the swarm clock passes a multiple of `every`, keeping the
        `keep` newest, until the run's last step is exported; `await written(folder, metadata)` after each."""
        last = 0
        while last < self.spec.total_steps:
            clock = (await self.refresh()).clock()
            if clock > last and (clock // every > last // every or clock >= self.spec.total_steps):
                folder = out / f"{SNAPSHOT_PREFIX}{clock:06d}"
                metadata = await self.export(folder, tokenizer)
                last = clock
                prune(out, keep)
                await written(folder, metadata)
            else:
                await asyncio.sleep(self.spec.record_period_s)


def _layout(config: ModelConfig, stage: int, n_stages: int) -> state.TensorMap:
    """The names and shapes of a stage's weights (meta tensors: nothing allocated)."""
    with torch.device("meta"):
        if stage == 0:
            piece: torch.nn.Module = DataPiece(TokenEmbedding(config), OutputHead(config))
        else:
            piece = DecoderStage(config, len(stage_layers(config, stage, n_stages)))
    return {name: p.detach() for name, p in piece.named_parameters()}


def prune(out: Path, keep: int) -> None:
    """Remove all but the `keep` newest snapshots in `out`."""
    snapshots = sorted(p for p in out.glob(f"{SNAPSHOT_PREFIX}*") if p.is_dir())
    for old in snapshots[: max(0, len(snapshots) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def validation_loss(folder: Path, corpus: Corpus, spec: RunSpec) -> float:
    """The validation loss of the model in `folder` (read back from its files) on the run's validation
    set: the figure the data nodes report, recomputed from the export."""
    config, split = read_model_folder(folder, spec.stages)
    pieces = [build_piece(config, k, spec.stages) for k in range(spec.stages + 1)]
    load_pieces(pieces, split)
    fixed = validation_set(corpus.val_tokens, spec.batch_size, spec.seq_len)
    return evaluate(cast(DataPiece, pieces[0]), pieces[1:], fixed)


async def run_export(
    initial_peers: Sequence[str],
    run_id: str,
    run_owners: Sequence[str],
    body: Callable[[Exporter], Awaitable[T]],
) -> T:
    """Join the run's DHT as a client, announce the exporter and run `await body(exporter)`; everything
    started here is shut down however it ends."""
    dht = SwarmDHT(run_id, initial_peers, client_mode=True, run_owners=run_owners)
    try:
        spec = await dht.wait_for_run(STATE_SECONDS)
        transport = Transport(await dht.replicate_p2p())
        exporter = Exporter(dht, spec, transport)
        announcing = asyncio.create_task(exporter.announce())
        try:
            await exporter.publish()
            return await body(exporter)
        finally:
            announcing.cancel()
            await asyncio.gather(announcing, return_exceptions=True)
            await transport.close()
    finally:
        await dht.close()


async def export_command(
    initial_peers: Sequence[str],
    run_id: str,
    run_owners: Sequence[str],
    out: Path,
    tokenizer: Path | None,
    every_steps: int | None,
    keep: int,
    evaluate: bool,
) -> int:
    """`swarmnode export`: one export (or snapshots every `every_steps`), one `exported` JSON line for each
    folder written (with its validation loss if `evaluate`). Returns the exit code (130 if interrupted)."""

    async def body(exporter: Exporter) -> None:
        spec = exporter.spec
        if tokenizer is not None and spec.tokenizer_digest not in (None, file_digest(tokenizer)):
            raise ExportError(
                f"the tokenizer {tokenizer} (digest {file_digest(tokenizer)}) is not the run's "
                f"(digest {spec.tokenizer_digest})"
            )
        # the run's own file: cached here, or fetched from its owners or data nodes (None: a run definition
        # from before digests, whose data nodes train the default tokenizer)
        run_file = await obtain_tokenizer(spec, tokenizer, exporter.dht, cache_dir())
        corpus = (
            await asyncio.to_thread(load_corpus, spec.data, run_file, spec.vocab_size) if evaluate else None
        )
        path = run_file or (corpus.tokenizer_path if corpus else await asyncio.to_thread(run_tokenizer, spec))
        vocab = load_tokenizer(path).get_vocab_size()
        if vocab != spec.vocab_size:
            raise ExportError(f"the tokenizer {path} has {vocab} tokens, the run's model {spec.vocab_size}")

        async def written(folder: Path, metadata: dict[str, Any]) -> None:
            loss = None if corpus is None else await asyncio.to_thread(validation_loss, folder, corpus, spec)
            emit("exported", path=str(folder), step=metadata["step"], steps=metadata["steps"], val_loss=loss)

        if every_steps is None:
            await written(out, await exporter.export(out, path))
        else:
            await exporter.export_every(out, path, every_steps, keep, written)

    main = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main.cancel)  # type: ignore[union-attr]
    try:
        await run_export(initial_peers, run_id, run_owners, body)
    except asyncio.CancelledError:
        return 130
    return 0
