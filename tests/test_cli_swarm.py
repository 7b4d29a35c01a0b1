"""`bootstrap`, `join` and `status` on the command line: bad input is a one-line error, never a traceback.

Flag and address mistakes are usage errors (exit 2) found before anything starts. A p2p daemon that cannot
start (no initial peer answers, an address that cannot be listened on) is a one-line error with exit 1: those
cases start a real p2pd, which exits on its own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from swarmnode.cli import main

PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJb3oK5ovA1gAHwG9cQ7yAqBwHgdBoRa8kBZ1iFZ3bVo2"  # nobody listens there


def usage_error(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), env={"SWARMNODE_INITIAL_PEERS": ""})
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # click's exit, nothing raised
    assert "Traceback" not in result.output
    return result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["join", "--stage", "x", "--initial-peers", PEER], "neither a stage number nor 'auto'"),
        (["join", "--stage", "-1", "--initial-peers", PEER], "stage numbers start at 0"),
        (["join", "--stage", "1"], "no initial peers given"),
        (["join", "--stage", "0", "--shard", "3/2", "--initial-peers", PEER], "shard 3 of 2 does not exist"),
        (["join", "--stage", "0", "--shard", "a", "--initial-peers", PEER], "'a' is not I/K"),
        (["join", "--stage", "1", "--initial-peers", "garbage"], "neither a multiaddr nor a readable file"),
        (["join", "--stage", "1", "--initial-peers", "/nonexistent/file"], "not a multiaddr with a peer id"),
        (
            ["join", "--stage", "1", "--initial-peers", "/ip4/127.0.0.1/tcp/9"],
            "not a multiaddr with a peer id",
        ),
        (["bootstrap", "--preset", "nope"], "unknown preset 'nope'"),
        (["bootstrap", "--stages", "0"], "0 is not in the range"),
        (["bootstrap", "--run", "/nonexistent/run.json"], "cannot read run file"),
        (["status"], "no initial peers given"),
        (["status", "--initial-peers", f"{PEER},/ip4/1.2.3.4"], "'/ip4/1.2.3.4' (from --initial-peers)"),
    ],
)
def test_bad_flags_are_usage_errors(args: list[str], message: str) -> None:
    assert message in usage_error(*args)


def test_a_peers_file_with_a_bad_line_is_named(tmp_path: Path) -> None:
    peers = tmp_path / "peers.txt"
    peers.write_text(f"{PEER}\nnot-an-address\n")
    output = usage_error("status", "--initial-peers", str(peers))
    assert "'not-an-address'" in output and str(peers) in output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["status", "--initial-peers", PEER], "Error: no initial peer answered"),
        (["bootstrap", "--host", "192.0.2.1"], "Error: cannot listen on 192.0.2.1:0"),  # not this machine's
    ],
)
def test_a_p2p_daemon_that_cannot_start_is_a_one_line_error(args: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "swarmnode", *args], capture_output=True, text=True, timeout=120, check=False
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert lines and lines[-1].startswith(message), done.stderr
