"""From the daemons' JSON lines to report.json and loss.png (real matplotlib), and the progress lines."""

from __future__ import annotations

import io
import json
import signal
import statistics
from pathlib import Path
from typing import Any

import pytest

import swarmnode.status
from swarmnode.cli.up import summary
from swarmnode.event_schema import Step, parse_line
from swarmnode.launcher import observe
from swarmnode.launcher.display import Display, StageCount, status_line
from swarmnode.launcher.observe import parse_snapshot
from swarmnode.launcher.record import RunRecord
from swarmnode.launcher.report import build_report, plot_loss, write_report
from swarmnode.launcher.result import RunOutcome, SwarmResult

START = 1_700_000_000.0


def line(event: str, at: float, **fields: object) -> str:
    return json.dumps({"event": event, **fields, "time": START + at})


def recorded_run() -> RunRecord:
    record = RunRecord(START)
    lines = [line("validation", 1.0, step=0, val_loss=8.4)]
    for step in range(1, 41):
        for skew in (0.0, 0.3):  # two data nodes
            loss, seconds = 8.0 - 0.05 * step + skew, 1.0 + step % 10 / 10  # 1.0 .. 1.9 s
            lines.append(line("step", 2.0 + step + skew, step=step, loss=loss, tokens=1024, seconds=seconds))
        if step % 20 == 0:
            lines.append(line("validation", 2.5 + step, step=step, val_loss=8.0 - 0.05 * step))
    lines += [
        line("microbatch_lost", 15.0, step=13, stage=2),
        line("microbatch_lost", 15.1, step=13, stage=2),
    ]
    lines.append(line("recovered", 20.0, stage=2, method="checkfree", seconds=2.5))
    lines.append(line("recovered", 30.0, stage=1, method="replica", seconds=1.0))
    lines.append(line("recovered", 31.0, stage=2, method="checkfree", seconds=3.5))
    for outer in (1, 2, 3, 4):  # two replicas of stage 1 pair three times of four; the data nodes never
        for paired in (outer != 2, outer != 2):
            lines.append(
                line("outer_step", 10.0 * outer, stage=1, outer_step=outer, paired=paired, matched=True)
            )
        lines.append(line("outer_step", 10.0 * outer, stage=0, outer_step=outer, paired=False, matched=False))
    for text in sorted(lines, key=lambda text: json.loads(text)["time"]):
        event = parse_line(text, 0.0)
        assert event is not None
        record.add(event)
        if isinstance(event, Step) and event.step == 15 and event.loss == 8.0 - 0.75:
            record.add_failure(START + 17.5, 2, "12D3KooWdead", "s2r1", "planned")
            record.stage_lost(START + 17.5, 2)
    return record


def test_record_figures() -> None:
    record = recorded_run()
    assert record.step == 40
    curve = record.loss_curve()
    assert [point.step for point in curve] == list(range(1, 41))
    assert curve[0].loss == pytest.approx(8.0 - 0.05 + 0.15)  # the mean of both data nodes
    assert curve[0].seconds == pytest.approx(3.0)  # placed at the first report
    assert record.initial_loss == pytest.approx(7.95 + 0.15)
    assert record.final_loss == pytest.approx(statistics.fmean(8.0 - 0.05 * s + 0.15 for s in range(31, 41)))
    assert record.initial_val_loss == pytest.approx(8.4)
    assert record.val_loss == pytest.approx(6.0)
    assert record.microbatches_lost == 2
    assert record.failures[0].step == 15 and record.failures[0].seconds == pytest.approx(17.5)
    assert [(r.stage, r.method, r.duration, r.downtime) for r in record.recoveries] == [
        (2, "checkfree", 2.5, pytest.approx(2.5)),  # lost at 17.5 s, rebuilt at 20 s
        (1, "replica", 1.0, None),
        (2, "checkfree", 3.5, None),  # another node of stage 2: the stage was not lost again
    ]
    # 80 reports of 1024 tokens from t=3.0 to t=42.3: the first report opens the interval.
    assert record.tokens_per_second() == pytest.approx(79 * 1024 / 39.3)
    assert record.tokens_per_second(window=4.9, now=START + 42.3) == pytest.approx(9 * 1024 / 4.3)


def test_report_json_and_plot(tmp_path: Path) -> None:
    record = recorded_run()
    settings = {
        "preset": "tiny",
        "stages": 3,
        "fail_rate": 0.0,
        "skip_ratio": 0.34,
        "planner": "random_skips",
    }
    nodes = [
        {
            "name": "s2r1",
            "pid": 123,
            "stage": 2,
            "peer_id": "12D3KooWdead",
            "exit_code": -9,
            "killed": True,
            "site": "Japan",
            "microbatches_served": 37,
        }
    ]
    network = {"file": "links.json", "placement": {"s2r1": "Japan"}}
    report = build_report(record, "completed", "40 steps done", 45.0, settings, nodes, None, 1.23456, network)
    write_report(tmp_path / "report.json", report)
    plot_loss(tmp_path / "loss.png", record, "test run")

    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved == json.loads(json.dumps(report))
    assert saved["steps_completed"] == 40
    assert saved["initial_loss"] == pytest.approx(8.1) and saved["final_loss"] < saved["initial_loss"]
    assert saved["val_loss"] == pytest.approx(6.0) and saved["initial_val_loss"] == pytest.approx(8.4)
    assert saved["tokens_per_second"] > 0
    assert saved["failures"] == [
        {
            "step": 15,
            "stage": 2,
            "peer_id": "12D3KooWdead",
            "node": "s2r1",
            "cause": "planned",
            "at_seconds": 17.5,
        }
    ]
    assert saved["recoveries"][0] == {
        "stage": 2,
        "method": "checkfree",
        "seconds": 2.5,
        "downtime_seconds": 2.5,
        "step": 18,
        "at_seconds": 20.0,
    }
    assert saved["recoveries_by_method"] == {
        "checkfree": {"count": 2, "mean_seconds": 3.0},
        "replica": {"count": 1, "mean_seconds": 1.0},
    }
    assert saved["microbatches_lost"] == 2
    assert saved["noloco"] == {
        "0": {"rounds": 4, "paired": 0, "alone": 4, "unmatched": 4, "paired_share": None},
        "1": {"rounds": 8, "paired": 6, "alone": 2, "unmatched": 0, "paired_share": 0.75},
    }
    assert saved["settings"] == settings and saved["nodes"] == nodes
    # 80 iterations, 8 of each of 1.0, 1.1, .., 1.9 s: the median is 1.45 s; the 90th percentile lies a
    # tenth of the way from the 72nd (1.8 s) to the 73rd (1.9 s)
    assert saved["iteration_seconds"] == {"median": 1.45, "p90": 1.81, "count": 80, "simulated": 1.2346}
    assert saved["skip_ratio"] == 0.34 and saved["planner"] == "random_skips" and saved["network"] == network
    assert len(saved["loss_curve"]) == 40 and len(saved["val_curve"]) == 3
    assert not (tmp_path / "report.json.partial").exists()

    png = (tmp_path / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def test_plot_of_a_run_without_steps(tmp_path: Path) -> None:
    record = RunRecord(START)
    record.add_failure(START + 3, 1, None, "s1r1", "crash")
    plot_loss(tmp_path / "loss.png", record, "nothing happened")
    report = build_report(record, "interrupted", "stopped by SIGINT at step 0", 3.0, {}, [])
    assert report["initial_loss"] is None and report["tokens_per_second"] is None
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_a_stage_never_rebuilt_is_reported(tmp_path: Path) -> None:
    record = recorded_run()
    record.add_failure(START + 41.0, 3, "12D3KooWgone", "s3r1", "planned")
    record.stage_lost(START + 41.0, 3)  # no node reports recovering stage 3 before the run ends
    report = build_report(record, "completed", "40 steps done", 45.0, {}, [])
    assert report["stages_not_recovered"] == [{"stage": 3, "lost_at_step": 40, "lost_at_seconds": 41.0}]
    line = summary(SwarmResult(RunOutcome.COMPLETED, "40 steps done", None, report))
    assert "replica x1 (1.0 s), stage 3 lost at step 40 and not rebuilt by the end, 2 microbatches" in line
    assert build_report(recorded_run(), "completed", "", 45.0, {}, [])["stages_not_recovered"] == []


def test_status_line_and_stage_counts() -> None:
    counts = {0: StageCount(2), 1: StageCount(1, recovering=1), 2: StageCount(), 3: StageCount(1, joining=2)}
    text = status_line(37, 200, 5.3123, 5.42, 1830.4, counts, 3)
    assert (
        text == "step 37/200 | loss 5.312 | val 5.420 | 1830 tok/s | nodes 0:2 1:1+1r 2:0! 3:1+2j | lost mb 3"
    )
    assert status_line(0, 10, None, None, None, {0: StageCount(1)}, 0) == "step 0/10 | nodes 0:1"


def test_display_throttles_status_lines() -> None:
    stream = io.StringIO()
    display = Display(stream, started=0.0, interval=0.0, heartbeat=3600.0)
    display.status(lambda: "a")
    display.status(lambda: "a")  # unchanged: skipped until the heartbeat
    display.status(lambda: "b")
    slow = Display(io.StringIO(), started=0.0, interval=3600.0)
    slow.status(lambda: "first")
    slow.status(lambda: pytest.fail("built before it was due"))
    display.event("stage 2 lost: no node left")
    lines = stream.getvalue().splitlines()
    assert [text.split("] ", 1)[1] for text in lines] == ["a", "b", "stage 2 lost: no node left"]
    assert all(text.startswith("[") and "s] " in text for text in lines)


class BrokenPipe(io.StringIO):
    """A stream whose reader went away (`swarmnode up 2>&1 | head`): every write fails."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        raise BrokenPipeError(32, "Broken pipe")


def test_display_gives_up_on_a_broken_stream() -> None:
    stream = BrokenPipe()
    display = Display(stream, started=0.0, interval=0.0)
    display.event("bootstrap ready")
    display.status(lambda: "step 1/10")
    display.event("killed s2r1")
    assert stream.writes == 1  # no error, and no further try after the first failed write


def test_parse_snapshot_counts_states() -> None:
    peers = [{"peer_id": "a", "state": "online"}, {"peer_id": "b", "state": "recovering"}]
    snapshot = {"run_id": "swarm", "complete": False, "loss": 5.0, "stages": [{"stage": 2, "peers": peers}]}
    assert parse_snapshot(json.dumps(snapshot)) == {2: StageCount(online=1, recovering=1)}
    assert parse_snapshot("INFO: not json") is None
    assert parse_snapshot('{"stages": [{"peers": []}]}') is None


def test_the_observer_skips_a_snapshot_whose_dht_read_timed_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = {"stages": [{"stage": 0, "peers": [{"peer_id": "a", "state": "online"}]}]}
    answers: list[Any] = [TimeoutError(), snapshot, SystemExit(0)]  # the SystemExit stands in for SIGTERM

    class Observer:
        def __init__(self, initial_peers: list[str], run_id: str) -> None:
            assert (initial_peers, run_id) == (["/ip4/127.0.0.1/tcp/1/p2p/x"], "swarm")

        def snapshot(self) -> dict[str, Any]:
            answer = answers.pop(0)
            if isinstance(answer, BaseException):
                raise answer
            return answer

        def close(self) -> None:
            pass

    monkeypatch.setattr(swarmnode.status, "SwarmObserver", Observer)
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)  # keep pytest's SIGTERM handling
    peers = tmp_path / "peers.txt"
    peers.write_text("/ip4/127.0.0.1/tcp/1/p2p/x\n")
    with pytest.raises(SystemExit):
        observe.main([str(peers), "swarm", "0"])
    out, err = capsys.readouterr()
    assert [parse_snapshot(line) for line in out.splitlines()] == [{0: StageCount(online=1)}]
    assert err == "a DHT read timed out\n" and answers == []
