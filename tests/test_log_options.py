"""`-v`, `--log-level` and `--log-file` on `bootstrap`, `join`, `export`, `up` and `train`: the level filters
swarmnode's log lines, the file receives them instead of stderr, and bad values are one-line usage errors;
`up` hands the level to its daemons."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cli_helpers import one_line_usage_error, run

from swarmnode.launcher.config import SwarmConfig

PROBE = """
import logging, sys
from pathlib import Path
from swarmnode.cli.log_options import configure
configure(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else None)
log = logging.getLogger("swarmnode.node.daemon")
log.debug("a debug line")
log.info("an info line")
log.warning("a warning line")
"""


def probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60, check=True
    )


def test_the_level_filters_and_the_file_takes_the_lines(tmp_path: Path) -> None:
    stderr = probe("warning").stderr
    assert "a warning line" in stderr and "an info line" not in stderr
    log = tmp_path / "node.log"
    log.write_text("an earlier line\n")
    done = probe("debug", str(log))
    assert done.stderr == ""
    lines = log.read_text().splitlines()
    assert lines[0] == "an earlier line"  # appended, not replaced
    assert [line.split(": ", 1)[1] for line in lines[1:]] == [
        "a debug line",
        "an info line",
        "a warning line",
    ]
    assert all("swarmnode.node.daemon" in line for line in lines[1:])


def test_bad_logging_options_are_one_line_usage_errors(tmp_path: Path) -> None:
    one_line_usage_error(*run("join", "--stage", "1", "--log-level", "loud"), "--log-level", "loud")
    missing = tmp_path / "no" / "such" / "dir" / "node.log"
    one_line_usage_error(*run("bootstrap", "--log-file", str(missing)), "--log-file", "cannot write")


def test_up_and_train_take_the_logging_options_and_up_hands_the_level_to_its_daemons(tmp_path: Path) -> None:
    one_line_usage_error(*run("up", "--log-level", "loud"), "--log-level", "loud")
    missing = tmp_path / "no" / "such" / "dir" / "up.log"
    one_line_usage_error(*run("train", "--log-file", str(missing)), "--log-file", "cannot write")
    quiet, loud = SwarmConfig(), SwarmConfig(log_level="debug")
    for argv in (quiet.bootstrap_argv(), quiet.join_argv(1, None)):
        assert "--log-level" not in argv
    for argv in (loud.bootstrap_argv(), loud.join_argv(1, None), loud.join_argv(None, None, standby=True)):
        assert argv[argv.index("--log-level") + 1] == "debug"
