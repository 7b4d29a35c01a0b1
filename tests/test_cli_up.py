"""`swarmnode up` on the command line: bad input is a one-line usage error (exit 2) and starts nothing."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from swarmnode.cli import up as up_module
from swarmnode.launcher import RunOutcome, SwarmResult, footprint

REPORT = {
    "steps_completed": 30,
    "initial_loss": 8.3,
    "final_loss": 6.1,
    "val_loss": None,
    "tokens_per_second": 2722.4,
    "failures": [{}],
    "recoveries_by_method": {"checkfree": {"count": 1, "mean_seconds": 2.13}},
    "stages_not_recovered": [],
    "microbatches_lost": 3,
}
SUMMARY = (
    "30 steps: loss 8.300 -> 6.100, validation ?, 2722 tokens/s, 1 failures, "
    "recoveries: checkfree x1 (2.1 s), 3 microbatches lost"
)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Any]:
    """Stands in for the launcher: records the configs it was given, and reports success."""
    monkeypatch.chdir(tmp_path)  # the default --out, ./swarm-out, is created before the launcher starts
    configs: list[Any] = []

    class FakeSwarm:
        def __init__(self, config: Any) -> None:
            configs.append(config)

        def run(self) -> SwarmResult:
            return SwarmResult(RunOutcome.COMPLETED, "30 steps done", None, REPORT)

    monkeypatch.setattr(up_module, "LocalSwarm", FakeSwarm)
    monkeypatch.setattr(footprint, "available_bytes", lambda: 16 * footprint.GIB)  # whatever this machine has
    return configs


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kill", "9@x"], "Invalid value for '--kill': '9@x' is not STAGE@STEP"),
        (["--kill", "2@0"], "Invalid value for '--kill': '2@0': the step must be at least 1"),
        (["--kill", "9@5"], "Invalid value for --kill: 9@5: stage 9 is beyond --stages 3 (stages 0..3)"),
        (["--stages", "2", "--kill", "3@5"], "stage 3 is beyond --stages 2"),
        (["--steps", "100", "--kill", "1@500"], "step 500 is not before the last step (--steps 100)"),
        (["--steps", "200", "--kill", "2@200"], "step 200 is not before the last step (--steps 200)"),
        (["--steps", "1", "--kill", "2@1"], "step 1 is not before the last step (--steps 1)"),
        (["--fail-rate", "1.5"], "Invalid value for '--fail-rate'"),
        (["--fail-rate", "1"], "Invalid value for '--fail-rate'"),
        (["--fail-rate", "nan"], "Invalid value for '--fail-rate': 'nan' is not a finite number"),
        (["--respawn-delay", "nan"], "Invalid value for '--respawn-delay': 'nan' is not a finite number"),
        (["--respawn-delay", "inf"], "Invalid value for '--respawn-delay': 'inf' is not a finite number"),
        (["--timeout", "nan"], "Invalid value for '--timeout': 'nan' is not a finite number"),
        (["--timeout", "inf"], "Invalid value for '--timeout': 'inf' is not a finite number"),
        (["--stall-timeout", "nan"], "Invalid value for '--stall-timeout': 'nan' is not a finite number"),
        (["--stall-timeout", "-1"], "Invalid value for '--stall-timeout'"),
        (
            ["--out", "/dev/null/x"],
            "Invalid value for --out: cannot create /dev/null/x/logs: Not a directory",
        ),
        (["--stages", "4"], "6 layers of preset 'tiny' do not divide into 4 stages"),
        (["--preset", "nope"], "Invalid value for --preset"),
        (["--replicas", "0"], "Invalid value for '--replicas'"),
        (["--data-nodes", "0"], "Invalid value for '--data-nodes'"),
        (["--respawn-delay", "-1"], "Invalid value for '--respawn-delay'"),
        (["--timeout", "0"], "Invalid value for '--timeout'"),
        (["--run-id", "a.b"], "run id 'a.b' must be 1-64 characters without '.'"),
        (["--batch-size", "0"], "Invalid value for '--batch-size'"),
        (["--seq-len", "4096"], "seq_len 4096 exceeds the preset's context 128"),
    ],
)
def test_bad_input_is_a_usage_error(started: list[Any], args: list[str], message: str) -> None:
    result = CliRunner().invoke(up_module.up, args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # no traceback
    error = result.output.strip().splitlines()[-1]
    assert error.startswith("Error: ") and message in error
    assert started == []


def test_good_input_configures_the_swarm(started: list[Any], tmp_path: Path) -> None:
    args = ["--stages", "2", "--replicas", "3", "--data-nodes", "1", "--steps", "50", "--fail-rate", "0.2"]
    args += ["--kill", "2@10", "--kill", "0@20", "--no-checkfree-plus", "--respawn-delay", "0.5"]
    args += ["--edge-swaps", "--no-edge-copies"]
    args += ["--out", str(tmp_path / "out"), "--seed", "7", "--run-id", "demo", "--timeout", "600"]
    args += ["--stall-timeout", "90", "--kill", "1@49"]
    result = CliRunner().invoke(up_module.up, args)
    assert result.exit_code == 0, result.output
    [config] = started
    assert (config.stages, config.replicas, config.data_nodes, config.steps) == (2, 3, 1, 50)
    assert config.fail_rate == 0.2 and [str(kill) for kill in config.kills] == ["2@10", "0@20", "1@49"]
    assert not config.checkfree_plus and config.respawn_delay == 0.5
    assert config.edge_swaps and "--edge-swaps" in config.bootstrap_argv()
    assert not config.edge_copies and "--no-edge-copies" in config.bootstrap_argv()
    assert (config.out, config.seed, config.run_id) == (tmp_path / "out", 7, "demo")
    assert (config.timeout, config.stall_timeout) == (600.0, 90.0)
    assert (tmp_path / "out" / "logs").is_dir()  # created before the launcher started
    assert result.output == SUMMARY + "\n"


def test_defaults_need_no_arguments(started: list[Any]) -> None:
    result = CliRunner().invoke(up_module.up, [])
    assert result.exit_code == 0, result.output
    [config] = started
    assert (config.preset, config.stages, config.replicas, config.data_nodes) == ("tiny", 3, 2, 2)
    assert (config.steps, config.fail_rate, config.out) == (100, 0.0, Path("swarm-out"))
    assert config.stall_timeout == 300.0
    assert [str(kill) for kill in config.kills] == ["2@50"]  # the demo shows a stage being rebuilt


@pytest.mark.parametrize(("steps", "kills"), [("1", []), ("2", ["2@1"]), ("3", ["2@1"])])
def test_the_default_kill_comes_before_the_last_step(
    started: list[Any], steps: str, kills: list[str]
) -> None:
    result = CliRunner().invoke(up_module.up, ["--steps", steps])
    assert result.exit_code == 0, result.output
    [config] = started
    assert [str(kill) for kill in config.kills] == kills  # one step only: nothing could fire, none planned


def test_stall_timeout_0_disables_the_bound(started: list[Any]) -> None:
    result = CliRunner().invoke(up_module.up, ["--stall-timeout", "0"])
    assert result.exit_code == 0, result.output
    assert started[0].stall_timeout is None


def test_calm_means_no_failures(started: list[Any]) -> None:
    result = CliRunner().invoke(up_module.up, ["--calm"])
    assert result.exit_code == 0, result.output
    [config] = started
    assert (config.fail_rate, config.kills) == (0.0, ())


@pytest.mark.parametrize(
    ("flags", "named"), [(["--kill", "1@5"], "--kill"), (["--fail-rate", "0.5"], "--fail-rate")]
)
def test_calm_with_failures_is_a_one_line_usage_error(
    started: list[Any], flags: list[str], named: str
) -> None:
    result = CliRunner().invoke(up_module.up, ["--calm", *flags])
    assert result.exit_code == 2 and not started, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "--calm" in errors[0] and named in errors[0], result.output


@pytest.mark.parametrize(
    ("outcome", "signum", "code"),
    [
        (RunOutcome.INTERRUPTED, 2, 130),
        (RunOutcome.INTERRUPTED, 15, 143),
        (RunOutcome.INTERRUPTED, 1, 129),
        (RunOutcome.INTERRUPTED, 3, 131),
        (RunOutcome.FAILED, None, 1),
        (RunOutcome.TIMEOUT, None, 1),
    ],
)
def test_exit_codes_and_the_summary_of_a_run_that_did_not_complete(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, outcome: RunOutcome, signum: int | None, code: int
) -> None:
    class EndedSwarm:
        def __init__(self, config: Any) -> None:
            pass

        def run(self) -> SwarmResult:
            return SwarmResult(outcome, "stopped", signum, REPORT)

    monkeypatch.setattr(up_module, "LocalSwarm", EndedSwarm)
    result = CliRunner().invoke(up_module.up, ["--out", str(tmp_path)])
    assert result.exit_code == code
    assert result.output == f"{outcome.value}: {SUMMARY}\n"


def test_a_swarm_this_machine_cannot_hold_is_refused_before_it_starts(started: list[Any]) -> None:
    # llama-124m's own batch, 64 x 512 tokens a microbatch: a stage node would pin 8 GiB a microbatch
    large = ["--preset", "llama-124m", "--device", "cpu"]
    result = CliRunner().invoke(up_module.up, large)
    assert result.exit_code == 2, result.output
    error = result.output.strip().splitlines()[-1]
    assert error.startswith("Error: this swarm needs about ") and "16.0 GiB available" in error
    assert "up to 8 microbatches of 64 x 512 tokens" in error
    assert error.endswith("use a smaller --preset or --seq-len, or fewer --replicas and --data-nodes")
    assert started == []
    result = CliRunner().invoke(
        up_module.up, ["--preset", "llama-124m", "--device", "cpu", "--seq-len", "128"]
    )
    assert result.exit_code == 2
    fit = re.fullmatch(r".*; use --batch-size (\d+) or less", result.output.strip().splitlines()[-1])
    assert fit is not None and 1 <= int(fit.group(1)) < 64  # shorter sequences: a smaller batch fits
    assert started == []


def test_a_smaller_batch_of_a_large_preset_fits(started: list[Any]) -> None:
    args = ["--preset", "llama-124m", "--device", "cpu", "--batch-size", "1", "--seq-len", "128"]
    result = CliRunner().invoke(up_module.up, [*args, "--replicas", "1", "--data-nodes", "1"])
    assert result.exit_code == 0, result.output
    [config] = started
    assert (config.batch_size, config.seq_len) == (1, 128)
    assert (config.settings()["batch_size"], config.settings()["seq_len"]) == (1, 128)  # in the report
    argv = config.bootstrap_argv()
    assert argv[argv.index("--batch-size") + 1] == "1" and argv[argv.index("--seq-len") + 1] == "128"
