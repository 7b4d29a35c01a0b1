"""`-v`, `--log-level` and `--log-file` on `bootstrap`, `join` and `export`: the level filters swarmnode's log
lines, the file receives them instead of stderr, and bad values are one-line usage errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cli_helpers import one_line_usage_error, run

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
