"""`join --human`: the events a volunteer sees as lines, and `--json` (or no terminal) keeps JSON."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from swarmnode.node import events
from swarmnode.node.human_lines import HumanLines

NOON = 1_800_000_000.0


@pytest.fixture
def human() -> Iterator[None]:
    events.print_human(10)
    try:
        yield
    finally:
        events.print_json()  # back to JSON for the rest of this process


def text(event: str, **fields: object) -> str | None:
    line = HumanLines(10).line(event, fields, NOON)
    return None if line is None else line.split(" ", 1)[1]  # without the local time


def test_a_data_node_shows_every_tenth_step_and_what_happens_to_it() -> None:
    step = {"loss": 5.4321, "tokens": 8192, "seconds": 2.0, "lost": 0}
    assert text("step", step=9, **step) is None
    assert text("step", step=10, **step) == "step 10 | loss 5.432 | 4,096 tokens/s"
    assert text("step", step=20, **{**step, "lost": 2}).endswith("| 2 microbatches lost")
    assert text("validation", step=25, val_loss=5.1234) == "validation loss 5.123 at step 25"
    assert text("finished", step=200, val_loss=4.5) == "finished the run at step 200: validation loss 4.500"
    assert (
        text("online", stage=0, peer_id="12D3KooWabcdefgh12345678")
        == "online: serving stage 0 as ...12345678"
    )


def test_a_stage_node_shows_its_progress_outer_steps_recoveries_and_refusals() -> None:
    progress = text("progress", stage=2, step=30, outer_step=3, served=60, lost=1, tokens_per_second=1234.5)
    assert progress == (
        "stage 2 | step 30 | outer step 3 | served 60 microbatches | 1,234 tokens/s busy | 1 dropped"
    )
    paired = text(
        "outer_step", stage=2, outer_step=3, paired=True, matched=True, partner="12D3KooWxyz98765432"
    )
    assert paired == "outer step 3: averaged with ...98765432"
    alone = text("outer_step", stage=2, outer_step=4, paired=False, matched=False, reason="no replica")
    assert alone == "outer step 4: alone (no replica)"
    assert (
        text("recovered", stage=2, method="checkfree", seconds=3.21)
        == "stage 2 recovered by checkfree in 3.2 s"
    )
    refused = text("rejected", peer_id="12D3KooWbad00000001", code="malformed", reason="not msgpack")
    assert refused == "refused ...00000001: malformed: not msgpack"
    assert text("joining", phase="dht", seconds=1.0) is None  # only in --json
    assert text("state_snapshot", stage=2, step=30, parts=["weights"]) is None


def test_emit_prints_human_lines_once_asked_and_json_otherwise(
    human: None, capsys: pytest.CaptureFixture[str]
) -> None:
    events.emit("validation", step=25, val_loss=5.0)
    events.emit("joining", phase="dht", seconds=1.0)  # not shown to a person
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].endswith("validation loss 5.000 at step 25")
    events.print_json()
    events.emit("validation", step=25, val_loss=5.0)
    line = json.loads(capsys.readouterr().out)
    assert line["event"] == "validation" and line["val_loss"] == 5.0


def test_every_steps_is_at_least_one() -> None:
    with pytest.raises(ValueError, match="every_steps"):
        HumanLines(0)
