"""`swarmnode train`: the reference trainer learns, and bad input is a one-line usage error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from swarmnode.cli import main
from swarmnode.optim import Schedule


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_train_tiny_lowers_validation_loss() -> None:
    code, output = run("train", "--preset", "tiny", "--steps", "30", "--eval-every", "10", "--json")
    assert code == 0, output
    figures = json.loads(output.strip().splitlines()[-1])
    assert figures["steps"] == 30
    assert figures["val_loss"] < 0.9 * figures["initial_val_loss"]
    assert figures["final_loss"] < figures["initial_loss"]
    assert figures["tokens_per_second"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "gpt-9"], "gpt-9"),
        (["--stages", "4"], "do not divide into 4 stages"),
        (["--data", "/nonexistent/corpus"], "/nonexistent/corpus"),
    ],
)
def test_bad_input_is_a_one_line_usage_error(args: list[str], message: str) -> None:
    code, output = run("train", "--steps", "1", *args)
    assert code == 2
    assert message in output
    assert "Traceback" not in output


def test_empty_data_folder_and_bad_tokenizer(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, output = run("train", "--steps", "1", "--data", str(empty))
    assert code == 2 and str(empty) in output and "Traceback" not in output

    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    code, output = run("train", "--steps", "1", "--tokenizer", str(bad))
    assert code == 2 and "tokenizer" in output and "Traceback" not in output


def test_schedule_warms_up_then_decays_to_the_floor() -> None:
    schedule = Schedule(peak_lr=1.0, warmup_steps=4, total_steps=20, min_ratio=0.1)
    assert schedule.lr_at(0) == pytest.approx(0.25)
    assert schedule.lr_at(3) == pytest.approx(1.0)
    assert schedule.lr_at(4) == pytest.approx(1.0)
    assert schedule.lr_at(12) == pytest.approx(0.55)
    assert schedule.lr_at(20) == pytest.approx(0.1)
    assert schedule.lr_at(500) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        Schedule(peak_lr=0.0, warmup_steps=1, total_steps=1)
