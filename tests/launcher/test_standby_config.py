"""`swarmnode up --standby N`: the standbys' command lines and how the report lists them."""

from __future__ import annotations

from pathlib import Path

from swarmnode.launcher import SwarmConfig
from swarmnode.launcher.nodes import LaunchedNode, daemon_entry
from swarmnode.launcher.procs import ChildProcess, LineTail


def test_a_standby_joins_with_no_stage_and_the_report_says_it_was_one(tmp_path: Path) -> None:
    config = SwarmConfig(standbys=1)
    argv = config.join_argv(None, None, standby=True)
    assert "--standby" in argv and "--stage" not in argv
    assert config.join_argv(None, None)[config.join_argv(None, None).index("--stage") + 1] == "auto"
    assert config.settings()["standbys"] == 1

    process = ChildProcess("standby1", ["true"], tmp_path)
    try:
        node = LaunchedNode(process, None, None, LineTail(process.stdout_path), False, standby=True)
        assert daemon_entry(node)["standby"] is True and daemon_entry(node)["stage"] is None
        node.stage = 2  # it took stage 2
        assert daemon_entry(node)["stage"] == 2
    finally:
        process.kill()
