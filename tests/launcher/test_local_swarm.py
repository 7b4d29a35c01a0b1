"""The supervisor end to end, with a stand-in `swarmnode` (fake_swarmnode.py) instead of real daemons.

Real processes, real process groups, real signals: only the daemons' training is faked.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from proc_state import running

from swarmnode.launcher import LocalSwarm, RunOutcome, StageKill, SwarmConfig

FAKE = (sys.executable, str(Path(__file__).with_name("fake_swarmnode.py")))


def fake_pids(pids_dir: Path) -> list[int]:
    return [int(pid) for path in pids_dir.iterdir() for pid in path.read_text().split()]


def assert_all_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 5
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in pids if running(pid)] == []


@pytest.fixture
def pids_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "pids"
    monkeypatch.setenv("FAKE_PIDS_DIR", str(path))
    return path


def config(tmp_path: Path, **overrides: object) -> SwarmConfig:
    settings: dict[str, object] = {
        "stages": 2,
        "replicas": 1,
        "data_nodes": 2,
        "steps": 12,
        "respawn_delay": 0.1,
        "out": tmp_path / "out",
        "timeout": 60.0,
        "command": FAKE,
        "observe": False,
    }
    return SwarmConfig(**{**settings, **overrides})  # type: ignore[arg-type]


def test_a_run_with_a_planned_kill(tmp_path: Path, pids_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_AUTO_STAGE", "2")
    monkeypatch.setenv("FAKE_STEP_S", "0.25")  # 5 s of training: at least one status line after the start
    stream = io.StringIO()
    # 5 s of steps, 0.25 s apart: longer than the stall bound, which each new step starts again
    settings = config(tmp_path, steps=20, kills=(StageKill(2, 4),), stall_timeout=3.0)
    result = LocalSwarm(settings, stream).run()
    progress = stream.getvalue()
    assert result.outcome is RunOutcome.COMPLETED, progress

    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report == result.report
    assert report["outcome"] == "completed" and report["steps_completed"] == 20
    assert report["initial_loss"] == pytest.approx(7.9) and report["final_loss"] < report["initial_loss"]
    assert report["initial_val_loss"] == pytest.approx(8.5) and report["val_loss"] == pytest.approx(6.2)
    assert report["tokens_per_second"] > 0
    model = str(tmp_path / "out" / "model")  # exported before the swarm ended, its loss read from the files
    assert report["model"] == {"path": model, "step": 0, "steps": {"0": 0}, "val_loss": 7.0}
    assert (tmp_path / "out" / "model" / "config.json").exists()
    assert report["microbatches_lost"] == 4  # two from each data node
    [failure] = report["failures"]
    assert failure["stage"] == 2 and failure["node"] == "s2r1" and failure["cause"] == "planned"
    assert failure["step"] >= 4 and failure["peer_id"].startswith("12D3KooWfake")
    [recovery] = report["recoveries"]
    assert (recovery["stage"], recovery["method"], recovery["seconds"]) == (2, "checkfree", 0.25)
    assert recovery["downtime_seconds"] >= 0.1  # the respawn delay, at least
    assert recovery["at_seconds"] > failure["at_seconds"]
    nodes = {node["name"]: node for node in report["nodes"]}
    assert set(nodes) == {"bootstrap", "data1", "data2", "s1r1", "s2r1", "spot1"}
    assert nodes["spot1"]["stage"] == 2 and nodes["s2r1"]["killed"] and nodes["data1"]["exit_code"] == 0
    assert nodes["data1"]["metrics_url"] == f"http://127.0.0.1:9{nodes['data1']['pid'] % 1000:03d}/metrics"
    assert nodes["bootstrap"]["metrics_url"] is None
    assert report["settings"]["kills"] == ["2@4"] and report["settings"]["steps"] == 20
    assert (tmp_path / "out" / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "out" / "logs" / "spot1.out").exists()

    for expected in (
        "bootstrap ready at /ip4/127.0.0.1/",
        "all 4 nodes joined",
        "killed s2r1 (12D3",
        "stage 2 lost: no node left",
        "spot1 starts as `join --stage auto` in place of s2r1",
        "spot1 joined stage 2",
        "stage 2 rebuilt by checkfree in 0.2 s (spot1, after ",
        "data1 finished",
        f"exporting the model to {model}",
        "validation loss 7.0000 recomputed from its files (the swarm's: 6.2",
        "completed: 20 steps done",
    ):
        assert expected in progress
    assert re.search(r"starting: [0-3]/4 nodes online", progress) and "| nodes 0:2 1:1 2:1 |" in progress
    assert_all_gone(fake_pids(pids_dir))  # daemons and the grandchildren they left behind


def test_bootstrap_failure_is_reported(
    tmp_path: Path, pids_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_BOOTSTRAP_EXIT", "4")
    result = LocalSwarm(config(tmp_path), io.StringIO()).run()
    assert result.outcome is RunOutcome.FAILED
    assert "the bootstrap peer exited with code 4: fake bootstrap: cannot listen" in result.message
    assert result.report["outcome"] == "failed"
    assert [(node["name"], node["exit_code"]) for node in result.report["nodes"]] == [("bootstrap", 4)]


def test_crashing_nodes_are_replaced_until_too_many(
    tmp_path: Path, pids_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_JOIN_EXIT", "3")
    stream = io.StringIO()
    result = LocalSwarm(config(tmp_path, respawn_delay=0.0), stream).run()
    assert result.outcome is RunOutcome.FAILED
    assert result.message.startswith("11 nodes crashed; the last: spot")
    assert "exited with code 3: fake join: boom" in result.message
    assert len(result.report["failures"]) == 11
    assert {failure["cause"] for failure in result.report["failures"]} == {"crash"}
    assert_all_gone(fake_pids(pids_dir))


def test_timeout(tmp_path: Path, pids_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "10")
    result = LocalSwarm(config(tmp_path, timeout=2.0), io.StringIO()).run()
    assert result.outcome is RunOutcome.TIMEOUT and "2 s timeout" in result.message
    assert_all_gone(fake_pids(pids_dir))


def test_a_stalled_run_fails(tmp_path: Path, pids_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "60")  # the data nodes start, and never report a step
    result = LocalSwarm(config(tmp_path, stall_timeout=1.0), io.StringIO()).run()
    assert result.outcome is RunOutcome.FAILED
    assert result.message.startswith("stalled: no data node reported a new step for 1 s (at step 0; see ")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["outcome"] == "failed" and report["settings"]["stall_timeout"] == 1.0
    assert_all_gone(fake_pids(pids_dir))


class BrokenPipe(io.StringIO):
    """stderr of `swarmnode up 2>&1 | head` once `head` has exited: every write fails."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_broken_progress_stream_changes_nothing(tmp_path: Path, pids_dir: Path) -> None:
    result = LocalSwarm(config(tmp_path), BrokenPipe()).run()
    assert result.outcome is RunOutcome.COMPLETED, result.message
    assert json.loads((tmp_path / "out" / "report.json").read_text())["outcome"] == "completed"
    assert_all_gone(fake_pids(pids_dir))


def test_children_are_ended_and_the_report_written_even_if_the_display_fails(
    tmp_path: Path, pids_dir: Path
) -> None:
    stream = io.StringIO()
    stream.close()  # every write raises ValueError, which the display does not swallow
    with pytest.raises(ValueError, match="closed file"):
        LocalSwarm(config(tmp_path), stream).run()
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert (report["outcome"], report["message"]) == ("failed", "the launcher stopped on an unexpected error")
    pids = fake_pids(pids_dir)
    assert len(pids) == 2  # the bootstrap and its grandchild, started before the first line was written
    assert_all_gone(pids)


RUNNER = """
import sys
from pathlib import Path
from swarmnode.launcher import LocalSwarm, SwarmConfig
config = SwarmConfig(stages=2, replicas=2, data_nodes=1, steps=10_000, out=Path(sys.argv[1]),
                     command=(sys.executable, sys.argv[2]), observe=False)
result = LocalSwarm(config).run()
sys.exit(128 + result.signum if result.signum else 1)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT])
def test_a_signal_ends_every_child_and_writes_the_report(tmp_path: Path, pids_dir: Path, signum: int) -> None:
    out = tmp_path / "out"
    launcher = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(RUNNER), str(out), FAKE[1]],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "FAKE_STEP_S": "0.2"},
        start_new_session=True,
    )
    try:
        assert launcher.stderr is not None
        for text in launcher.stderr:
            if "all 5 nodes joined" in text:
                break
        time.sleep(0.5)
        launcher.send_signal(signum)
        assert launcher.wait(timeout=30) == 128 + signum
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    report = json.loads((out / "report.json").read_text())
    assert report["outcome"] == "interrupted"
    assert report["message"].startswith(f"stopped by {signal.Signals(signum).name} at step")
    assert report["steps_completed"] >= 1 and (out / "loss.png").exists()
    pids = fake_pids(pids_dir)
    assert len(pids) == 2 * 6  # bootstrap, a data node, 2 x 2 stage nodes, each with its grandchild
    assert_all_gone(pids)
