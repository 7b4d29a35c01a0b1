"""`swarmnode bootstrap`, `swarmnode join` and `swarmnode status`: the swarm's daemons and its view."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from swarmnode.cli.compute import device_option, device_or_fail, dtype_option
from swarmnode.cli.config_file import config_option
from swarmnode.cli.log_options import logging_options
from swarmnode.cli.network_options import network_options
from swarmnode.cli.options import batch_options
from swarmnode.cli.reach_options import reach_options
from swarmnode.node.human_lines import PROGRESS_EVERY_STEPS
from swarmnode.runspec import PLANNERS, RunSpec, RunSpecError, RunVersionMismatch

if TYPE_CHECKING:
    from protocols.links import Network
    from swarmnode.dht import Reach
    from swarmnode.node.seed import SeedWeights

PEERS_HELP = "Multiaddrs (comma separated) or a file with one per line; also $SWARMNODE_INITIAL_PEERS."
IDENTITY_HELP = "Keep this node's key (its peer id) in FILE, created if missing, so it survives restarts."
OWNER_HELP = (
    "Peer id of the run's owner (the bootstrap: the id at the end of its address); the run definition is "
    "taken only from it. Default: the peers named by --initial-peers."
)
RUN_ID_HELP = "Name of the run on the DHT (the bootstrap's --run-id)."
PORT_HELP = "TCP port to listen on (0: any free port)."
METRICS_PORT_HELP = (
    "Serve Prometheus metrics on this port (0: any free port, announced in a `metrics` event)."
)
METRICS_HOST_HELP = "Address the metrics endpoint listens on."
DHT_TIMEOUT = "a DHT call got no answer within {seconds:g} s"  # `dht.DHT_CALL_TIMEOUT_S`


def _run_async(coro) -> int:  # type: ignore[no-untyped-def]
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # uvloop is a dependency; this only guards unusual platforms
        return asyncio.run(coro)


def _peers_file_or_fail(path: Path | None) -> None:
    """Create the folder of `--peers-file` now, so that a path that cannot be written is a usage error before
    the DHT starts (the file is written once it runs)."""
    if path is None:
        return
    if path.is_dir():
        raise click.BadParameter(f"{path} is a directory", param_hint="--peers-file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise click.BadParameter(
            f"cannot create {path.parent}: {error.strerror}", param_hint="--peers-file"
        ) from None


def _identity_or_fail(path: Path | None) -> Path | None:
    """`--identity`: an existing file must hold a usable key, and a new one must be creatable."""
    from swarmnode.identity import Identity, IdentityError

    if path is None:
        return None
    try:
        if path.exists():
            Identity.load(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
    except (IdentityError, OSError) as error:
        raise click.BadParameter(str(error), param_hint="--identity") from None
    return path


def _owners_or_fail(values: tuple[str, ...]) -> tuple[str, ...]:
    from swarmnode.identity import IdentityError, public_key_of

    for value in values:
        try:
            public_key_of(value)
        except IdentityError as error:
            raise click.BadParameter(str(error), param_hint="--run-owner") from None
    return values


def _is_ip(host: str) -> bool:
    """Whether `host` is one IP address (the direct path listens there; a name may resolve to several)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _peers_or_fail(value: str | None) -> list[str]:
    from swarmnode.dht import read_initial_peers

    try:
        peers = read_initial_peers(value)
    except (OSError, ValueError) as error:
        raise click.BadParameter(str(error), param_hint="--initial-peers") from None
    if not peers:
        listed = value and Path(value).is_file()
        why = f"no initial peers: the file {value} lists none" if listed else "no initial peers given"
        raise click.BadParameter(why, param_hint="--initial-peers")
    return peers


@click.command()
@config_option
@click.option("--preset", default=None, help="Model preset (default: tiny, or the run file's).")
@click.option(
    "--run", "run_file", type=click.Path(path_type=Path), default=None, help="A run definition JSON."
)
@click.option("--stages", type=click.IntRange(min=1), default=None, help="Transformer stages (ids 0..S).")
@click.option("--run-id", default=None, help="Name of the run on the DHT.")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Optimizer steps of each data node.")
@click.option(
    "--microbatches",
    type=click.IntRange(min=1),
    default=None,
    help="Microbatches per iteration for each replica of the narrowest stage.",
)
@batch_options
@click.option(
    "--data",
    default=None,
    help="What every data node reads: a .txt/.jsonl/.parquet file or folder (the same path on every data "
    "node), or hf:NAME[:CONFIG][:SPLIT], a Hugging Face dataset (default: the stdlib corpus).",
)
@click.option(
    "--text-column",
    default=None,
    help="The field or column holding the text (.jsonl, .parquet, hf:; default: text).",
)
@click.option(
    "--tokenizer",
    type=click.Path(path_type=Path),
    default=None,
    help="The run's tokenizer.json: its vocabulary sets the model's, and data nodes must pass the same file "
    "(default: a BPE trained on the data).",
)
@click.option("--seed", type=int, default=None, help="Seeds the initial weights and the data order.")
@click.option(
    "--checkfree-plus/--no-checkfree-plus",
    default=None,
    help="CheckFree+ (default on): copies of the embeddings and of the edge stages next door (see "
    "--edge-copies, --edge-swaps).",
)
@click.option(
    "--edge-copies/--no-edge-copies",
    default=None,
    help="Stage 2 keeps a copy of stage 1's weights and stage s-1 one of stage s's, refreshed every 10 "
    "steps, which rebuild a lost edge stage (default on; docs/design.md).",
)
@click.option(
    "--edge-swaps/--no-edge-swaps",
    default=None,
    help="The paper's CheckFree+ edge-stage swaps, on half the microbatches with 4 or more transformer "
    "stages (default off: they cost 2-10% of validation loss when no edge stage is lost; "
    "docs/swarm-quality.md).",
)
@click.option(
    "--skip-ratio",
    type=click.FloatRange(0.0, 1.0, max_open=True),
    default=None,
    help="Share of stages a SkipPipe path may skip (default 0: every path visits every stage).",
)
@click.option(
    "--planner",
    type=click.Choice(PLANNERS),
    default=None,
    help="How data nodes choose paths that skip: SkipPipe's scheduler (default) or random skips in stage "
    "order (the paper's baseline, for comparisons).",
)
@click.option("--noloco-every", type=click.IntRange(min=1), default=None, help="NoLoCo inner steps H.")
@click.option(
    "--min-data-nodes",
    type=click.IntRange(min=1),
    default=None,
    help="A fresh swarm trains once this many data nodes are online, so they start together (default 1).",
)
@click.option(
    "--min-replicas",
    type=click.IntRange(min=1),
    default=None,
    help="... and this many nodes of every transformer stage, so that every replica trains from the first "
    "step (default 1).",
)
@click.option(
    "--compression",
    type=click.Choice(["none", "float16"]),
    default=None,
    help="How float32 activations travel (float16 halves the bytes).",
)
@dtype_option("The run's compute dtype, and the dtype activations travel in (default: float32).")
@click.option(
    "--init-from",
    type=click.Path(path_type=Path),
    default=None,
    metavar="DIR",
    help="Start the run from the weights of a Hugging Face Llama folder (an export); this peer serves them.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True, help=PORT_HELP)
@click.option("--public", is_flag=True, help="Opt in to NAT port mapping (real deployments only).")
@click.option(
    "--peers-file", type=click.Path(path_type=Path), default=None, help="Write the multiaddrs here."
)
@click.option("--identity", type=click.Path(path_type=Path), default=None, help=IDENTITY_HELP)
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, help=METRICS_PORT_HELP)
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help=METRICS_HOST_HELP)
@reach_options
@logging_options
def bootstrap(
    preset: str | None,
    run_file: Path | None,
    stages: int | None,
    run_id: str | None,
    steps: int | None,
    microbatches: int | None,
    batch_size: int | None,
    seq_len: int | None,
    data: str | None,
    text_column: str | None,
    tokenizer: Path | None,
    seed: int | None,
    checkfree_plus: bool | None,
    edge_copies: bool | None,
    edge_swaps: bool | None,
    skip_ratio: float | None,
    planner: str | None,
    noloco_every: int | None,
    min_data_nodes: int | None,
    min_replicas: int | None,
    compression: str | None,
    dtype: str | None,
    init_from: Path | None,
    host: str,
    port: int,
    public: bool,
    peers_file: Path | None,
    identity: Path | None,
    metrics_port: int | None,
    metrics_host: str,
    reach: Reach,
) -> None:
    """Run the swarm's entry peer: publish the run definition and print the multiaddrs to join.

    Its peer id owns the run: joiners take the run definition only from it."""
    from swarmnode.data import DataError, check_splits, load_corpus
    from swarmnode.dht import DHT_CALL_TIMEOUT_S, DHTUnavailable
    from swarmnode.node.bootstrap import run_bootstrap

    if preset is not None and run_file is not None:
        raise click.UsageError("give either --preset or --run, not both")
    _peers_file_or_fail(peers_file)
    identity = _identity_or_fail(identity)
    try:
        base = RunSpec.from_file(run_file) if run_file is not None else RunSpec.for_preset(preset or "tiny")
        spec = base.with_overrides(
            run_id=run_id,
            stages=stages,
            total_steps=steps,
            microbatches=microbatches,
            batch_size=batch_size,
            seq_len=seq_len,
            seed=seed,
            checkfree_plus=checkfree_plus,
            edge_copies=edge_copies,
            edge_swaps=edge_swaps,
            skip_ratio=skip_ratio,
            planner=planner,
            noloco_inner_steps=noloco_every,
            min_data_nodes=min_data_nodes,
            min_replicas=min_replicas,
            compression=compression,
            dtype=dtype,
        ).with_data(data, text_column)
        corpus = load_corpus(spec.source, tokenizer, spec.vocab_size)
        check_splits(corpus, spec.seq_len, str(spec.source))
    except (RunSpecError, ValueError, DataError) as error:
        raise click.UsageError(str(error.args[0] if error.args else error)) from None
    spec = spec.with_overrides(vocab_size=corpus.vocab_size, tokenizer_digest=corpus.tokenizer_digest)
    spec = spec.with_fingerprint(corpus.source_fingerprint)
    seed = None
    if init_from is not None:
        seed = _seed_or_fail(init_from, spec, corpus.tokenizer_path)
        spec = spec.with_overrides(init_digests=",".join(seed.digests))
    try:
        metrics = None if metrics_port is None else (metrics_host, metrics_port)
        code = _run_async(
            run_bootstrap(
                spec, host, port, public, peers_file, identity, seed, metrics, reach, corpus.tokenizer_path
            )
        )
    except DHTUnavailable as error:
        raise click.ClickException(str(error)) from None
    except TimeoutError:
        timeout = DHT_TIMEOUT.format(seconds=DHT_CALL_TIMEOUT_S)
        raise click.ClickException(f"publishing the run: {timeout}") from None
    raise SystemExit(code)


def _seed_or_fail(folder: Path, spec: RunSpec, tokenizer: Path) -> SeedWeights:
    """`--init-from DIR`: a Llama folder of the run's shape and vocabulary, tokenised as the run's data nodes
    tokenise (the field or file that differs is named)."""
    from swarmnode.modeldir import ModelFolderError, tokenizer_of
    from swarmnode.node.seed import read_seed

    theirs = tokenizer_of(folder) if folder.is_dir() else None
    if theirs is not None and theirs.read_bytes() != tokenizer.read_bytes():
        raise click.BadParameter(
            f"{theirs} is not the run's tokenizer ({tokenizer}): a model trained with another tokenizer "
            "cannot start this run",
            param_hint="--init-from",
        )
    try:
        return read_seed(folder, spec)
    except ModelFolderError as error:
        raise click.BadParameter(str(error), param_hint="--init-from") from None


def _stage(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        stage = int(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is neither a stage number nor 'auto'", param_hint="--stage"
        ) from None
    if stage < 0:
        raise click.BadParameter("stage numbers start at 0 (the data stage)", param_hint="--stage")
    return stage


def _shard(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        index, count = (int(part) for part in value.split("/"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not I/K", param_hint="--shard") from None
    if not 0 <= index < count:
        raise click.BadParameter(f"shard {index} of {count} does not exist", param_hint="--shard")
    return index, count


@click.command()
@config_option
@click.option("--stage", default=None, help="Stage to serve: 0 (data), 1..S, or 'auto'.")
@click.option("--initial-peers", envvar="SWARMNODE_INITIAL_PEERS", default=None, help=PEERS_HELP)
@click.option("--run-id", default="swarm", show_default=True, help=RUN_ID_HELP)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True, help=PORT_HELP)
@click.option("--public", is_flag=True, help="Opt in to NAT port mapping (real deployments only).")
@click.option(
    "--direct/--no-direct",
    default=None,
    help="Also send tensors over direct TCP to peers that offer it: encrypted and bound to both peers' "
    "libp2p identities (plaintext between loopback daemons). Default: on when --host is an IP address.",
)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Torch threads for this node.")
@click.option(
    "--shard",
    default=None,
    help="Data nodes: read only shard I/K of the training data, in a fixed order (default: all of it, in an "
    "order of this node's own, so that replicas of a data node read different batches).",
)
@click.option(
    "--tokenizer", type=click.Path(path_type=Path), default=None, help="Data nodes: a tokenizer.json."
)
@click.option(
    "--rebalance", is_flag=True, help="Move to a stage that lost all its nodes if this one has spares."
)
@click.option(
    "--standby",
    is_flag=True,
    help="Hold no stage: start, join the DHT and take over a transformer stage the moment its last node is "
    "gone (rebuilt as a replacement would). No --stage, or --stage auto.",
)
@click.option("--identity", type=click.Path(path_type=Path), default=None, help=IDENTITY_HELP)
@click.option("--run-owner", "run_owners", multiple=True, envvar="SWARMNODE_RUN_OWNER", help=OWNER_HELP)
@click.option(
    "--linger",
    is_flag=True,
    help="Data nodes: after the run's last step, stay online until stopped, serving the final weights "
    "(to `swarmnode export`).",
)
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, help=METRICS_PORT_HELP)
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help=METRICS_HOST_HELP)
@device_option
@dtype_option("This node's compute dtype (autocast; weights stay float32). Default: the run's.")
@click.option("--dump-recovery", type=click.Path(path_type=Path), default=None, hidden=True)
@click.option(
    "--json/--human",
    "as_json",
    default=None,
    help="Print every event as one JSON object per line (the default when stdout is not a terminal: "
    f"`up`, docker, log collectors), or lines for a person (the default on a terminal): steps and stage "
    f"progress every {PROGRESS_EVERY_STEPS} steps, validation, outer steps, recoveries, refusals.",
)
@reach_options
@logging_options
@network_options
def join(
    stage: str | None,
    initial_peers: str | None,
    run_id: str,
    host: str,
    port: int,
    public: bool,
    direct: bool | None,
    threads: int | None,
    shard: str | None,
    tokenizer: Path | None,
    rebalance: bool,
    standby: bool,
    identity: Path | None,
    run_owners: tuple[str, ...],
    linger: bool,
    metrics_port: int | None,
    metrics_host: str,
    device: str,
    dtype: str | None,
    dump_recovery: Path | None,
    as_json: bool | None,
    network: Network | None,
    site: str | None,
    reach: Reach,
) -> None:
    """Run one daemon serving a stage of the run the initial peers belong to."""
    from swarmnode.data import DataError
    from swarmnode.dht import DHTUnavailable, RunNotFound
    from swarmnode.node.run import JoinOptions, JoinRefused, run_join
    from swarmnode.node.seed import SeedError
    from swarmnode.precision import PrecisionError

    if stage is None and not standby:
        raise click.UsageError("Missing option '--stage' (or give --standby).")
    stage_id = None if stage is None else _stage(stage)
    if standby and stage_id is not None:
        raise click.BadParameter(
            "a standby takes whichever stage is lost: give no --stage", param_hint="--stage"
        )
    device_or_fail(device)
    if sys.stdout.isatty() if as_json is None else not as_json:
        from swarmnode.node.events import print_human

        print_human(PROGRESS_EVERY_STEPS)
    options = JoinOptions(
        run_id=run_id,
        stage=stage_id,
        initial_peers=tuple(_peers_or_fail(initial_peers)),
        host=host,
        port=port,
        public=public,
        direct=direct if direct is not None else _is_ip(host),
        threads=threads,
        shard=_shard(shard),
        tokenizer=tokenizer,
        dump_recovery=dump_recovery,
        rebalance=rebalance,
        standby=standby,
        identity=_identity_or_fail(identity),
        run_owners=_owners_or_fail(run_owners),
        linger=linger,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        device=device,
        dtype=dtype,
        network=network,
        site=site,
        reach=reach,
    )
    try:
        code = _run_async(run_join(options))
    except (RunVersionMismatch, SeedError) as error:
        raise click.ClickException(str(error)) from None
    except (JoinRefused, PrecisionError, DataError) as error:
        raise click.UsageError(str(error)) from None
    except RunNotFound as error:
        raise click.ClickException(f"{error} (check --run-id and --initial-peers)") from None
    except DHTUnavailable as error:
        raise click.ClickException(str(error)) from None
    _exit_at_once(code)


def _exit_at_once(code: int) -> NoReturn:
    """End a daemon that has shut down in order (its node, DHT and p2pd closed) without the
    interpreter's teardown: collecting torch's and hivemind's objects took seconds of CPU, several
    daemons' side by side outlasted the launcher's grace period, and they were SIGKILLed."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


@click.command()
@click.option("--initial-peers", envvar="SWARMNODE_INITIAL_PEERS", default=None, help=PEERS_HELP)
@click.option("--run-id", default="swarm", show_default=True, help=RUN_ID_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--watch", is_flag=True, help="Refresh every 2 seconds until interrupted.")
@click.option("--run-owner", "run_owners", multiple=True, envvar="SWARMNODE_RUN_OWNER", help=OWNER_HELP)
def status(
    initial_peers: str | None, run_id: str, as_json: bool, watch: bool, run_owners: tuple[str, ...]
) -> None:
    """Show the swarm: stages, their peers and states, steps, loss, throughput (read from the DHT only)."""
    from swarmnode.dht import DHT_CALL_TIMEOUT_S, DHTUnavailable
    from swarmnode.status import SwarmObserver, format_table

    timeout = DHT_TIMEOUT.format(seconds=DHT_CALL_TIMEOUT_S)

    try:
        observer = SwarmObserver(_peers_or_fail(initial_peers), run_id, _owners_or_fail(run_owners))
    except DHTUnavailable as error:
        raise click.ClickException(str(error)) from None
    try:
        while True:
            try:
                summary = observer.snapshot()
            except RunVersionMismatch as error:
                raise click.ClickException(str(error)) from None
            except TimeoutError:
                if not watch:
                    raise click.ClickException(timeout) from None
                click.echo(f"{time.strftime('%H:%M:%S')} {timeout}; trying again", err=True)
            else:
                click.echo(json.dumps(summary) if as_json else format_table(summary))
            if not watch:
                break
            time.sleep(2.0)
    except KeyboardInterrupt:
        pass
    finally:
        observer.close()
