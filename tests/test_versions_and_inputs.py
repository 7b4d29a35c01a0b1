"""Versions and bad input: a run definition of another swarmnode is refused in one line that names both
versions and what to install; data nodes must tokenise as the run does; short data, empty peer files,
`up --calm` with failures and unknown run fields are one-line errors naming what is at fault; every
option has help text."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from swarm_harness import LocalTestSwarm, python_env

from protocols.messages import PROTOCOL_VERSION
from swarmnode import __version__
from swarmnode.cli import main
from swarmnode.data import load_corpus
from swarmnode.dht import SwarmDHT
from swarmnode.runspec import RunSpec, RunSpecError, RunVersionMismatch


def one_line_error(result: click.testing.Result, code: int, *words: str) -> None:
    assert result.exit_code == code and "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and all(word in errors[0] for word in words), result.output


def test_a_run_of_another_protocol_or_a_newer_swarmnode_names_both_versions() -> None:
    raw = {**RunSpec().to_dict(), "protocol_version": PROTOCOL_VERSION + 1, "swarmnode_version": "9.1.0"}
    with pytest.raises(RunVersionMismatch) as caught:
        RunSpec.from_dict(raw)
    for words in ("swarmnode 9.1.0", f"wire protocol {PROTOCOL_VERSION + 1}", f"swarmnode {__version__}"):
        assert words in str(caught.value)
    assert "pip install 'swarmnode==9.1.0'" in str(caught.value)
    newer = {**RunSpec().to_dict(), "swarmnode_version": "9.1.0", "relay": "on"}  # a field this one lacks
    with pytest.raises(RunVersionMismatch, match=r"swarmnode 9\.1\.0"):
        RunSpec.from_dict(newer)
    same = {**RunSpec().to_dict(), "relay": "on"}
    with pytest.raises(RunSpecError, match=r"unknown run field.*relay.*the fields are run_id, preset"):
        RunSpec.from_dict(same)
    older = {
        k: v for k, v in RunSpec().to_dict().items() if k not in ("swarmnode_version", "tokenizer_digest")
    }
    assert RunSpec.from_dict({**older, "swarmnode_version": "0.0.9"}).swarmnode_version == "0.0.9"


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_joining_a_run_of_another_protocol_fails_at_once_in_one_line(tmp_path: Path) -> None:
    owner = SwarmDHT("vrun", (), "127.0.0.1", 0, False)
    try:
        asyncio.run(owner.publish_run(RunSpec(run_id="vrun", protocol_version=PROTOCOL_VERSION + 1), 60.0))
        peers = tmp_path / "peers.txt"
        peers.write_text("\n".join(owner.visible_maddrs()) + "\n")
        argv = [sys.executable, "-m", "swarmnode", "join", "--stage", "1", "--run-id", "vrun"]
        started = time.monotonic()
        done = subprocess.run(
            [*argv, "--initial-peers", str(peers)],
            capture_output=True,
            text=True,
            timeout=90,
            env=python_env(),
            check=False,
        )
        assert done.returncode == 1, done.stderr[-2000:]
        assert time.monotonic() - started < 45  # not the 60 s wait for a run it would never accept
        errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and f"wire protocol {PROTOCOL_VERSION + 1}" in errors[0], done.stderr[-2000:]
        assert "Traceback" not in done.stderr
    finally:
        owner.shutdown()


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_a_data_node_with_another_tokenizer_is_refused_in_one_line(
    swarm: LocalTestSwarm, tmp_path: Path
) -> None:
    other = tmp_path / "tokenizer.json"  # the same vocabulary size, other bytes: not the run's file
    default = json.loads(Path(load_corpus().tokenizer_path).read_text())
    other.write_text(json.dumps(default, indent=1))
    spec = swarm.bootstrap(steps=2).events("bootstrap")[0]["run"]
    assert (
        spec["tokenizer_digest"] == load_corpus().tokenizer_digest
        and spec["swarmnode_version"] == __version__
    )
    data = swarm.join(0, "--tokenizer", str(other))
    assert data.wait_exit(90) == 2
    errors = [line for line in data.stderr_tail(400).splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "is not the run's" in errors[0] and "--tokenizer" in errors[0]


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_a_stage_the_run_lacks_or_a_taken_metrics_port_is_one_line_and_nothing_else(
    swarm: LocalTestSwarm,
) -> None:
    """Errors the volunteer can fix are one line (exit 2); a fault elsewhere is no longer dressed up as a
    usage error (a planner bug once printed "Usage: ... Error: math domain error")."""
    stages = swarm.bootstrap(steps=2).events("bootstrap")[0]["run"]["stages"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        nodes = {
            f"stage {stages + 1} does not exist": swarm.join(stages + 1),
            f"cannot serve metrics on 127.0.0.1:{port}": swarm.join(1, "--metrics-port", str(port)),
        }
        for words, node in nodes.items():
            assert node.wait_exit(90) == 2, node.stderr_tail()
            tail = node.stderr_tail(400)
            errors = [line for line in tail.splitlines() if line.startswith("Error:")]
            assert len(errors) == 1 and words in errors[0] and "Traceback" not in tail, tail


def test_short_data_names_the_file_and_the_split(tmp_path: Path) -> None:
    small = tmp_path / "small.txt"
    small.write_text("def f(x):\n    return x\n" * 3)
    result = CliRunner().invoke(main, ["train", "--steps", "1", "--data", str(small)])
    one_line_error(result, 2, str(small), "split has", "sequence length")


def test_an_empty_peers_file_is_named(tmp_path: Path) -> None:
    empty = tmp_path / "peers.txt"
    empty.write_text("\n")
    result = CliRunner().invoke(main, ["status", "--initial-peers", str(empty)])
    one_line_error(result, 2, "--initial-peers", str(empty), "lists none")


def test_a_run_file_with_an_unknown_field_lists_the_valid_ones(tmp_path: Path) -> None:
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"preset": "tiny", "stagez": 3}))
    result = CliRunner().invoke(main, ["bootstrap", "--run", str(run)])
    one_line_error(result, 2, "stagez", "the fields are", "stages", "noloco_inner_steps")


def test_every_option_has_help_text() -> None:
    missing = [
        f"{name} {'/'.join(param.opts)}"
        for name, command in main.commands.items()
        for param in command.params
        if isinstance(param, click.Option) and not param.hidden and not param.help
    ]
    assert not missing, missing
