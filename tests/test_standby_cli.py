"""`join --standby` on the command line: it takes no stage of its own, and says so in one line."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from swarmnode.cli import main

PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJb3oK5ovA1gAHwG9cQ7yAqBwHgdBoRa8kBZ1iFZ3bVo2"  # nobody listens there


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["join", "--standby", "--stage", "2", "--initial-peers", PEER], "give no --stage"),
        (["join", "--standby", "--stage", "0", "--initial-peers", PEER], "give no --stage"),
        (["join", "--initial-peers", PEER], "Missing option '--stage' (or give --standby)"),
    ],
)
def test_a_standby_with_a_stage_or_a_node_with_neither_is_a_usage_error(
    args: list[str], message: str
) -> None:
    result = CliRunner().invoke(main, args, env={"SWARMNODE_INITIAL_PEERS": ""})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert message in result.output and "Traceback" not in result.output
