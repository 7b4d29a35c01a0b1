"""`--config FILE` (TOML) on `bootstrap`, `join` and `up`: the file sets options, a command's table wins over
the top level, flags override both, and a bad file is a one-line usage error naming the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from swarmnode.cli import main


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def the_error(code: int, output: str) -> str:
    assert code == 2 and "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, output
    return errors[0]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "swarm.toml"
    path.write_text(text)
    return str(path)


def test_the_file_sets_options_its_table_wins_and_flags_override(tmp_path: Path) -> None:
    config = write(tmp_path, 'device = "tpu"\nstages = 4\n[join]\nstage = 1\ndevice = "npu"\n')
    assert "unknown device 'npu'" in the_error(*invoke("join", "--config", config))  # [join] over the top
    assert "unknown device 'gpu'" in the_error(*invoke("join", "--config", config, "--device", "gpu"))
    assert "into 4 stages" in the_error(*invoke("bootstrap", "--config", config))  # the top level
    assert "into 5 stages" in the_error(*invoke("bootstrap", "--config", config, "--stages", "5"))
    assert "into 4 stages" in the_error(*invoke("up", "--config", config))  # up has --stages and --device


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("stagez = 1\n", ["unknown key 'stagez'", "known:", "initial-peers"]),
        ('[join]\npreset = "tiny"\n', ["unknown key 'preset' in [join]"]),
        ("stage = [1, 2]\n", ["'stage' takes one value"]),
        ("[join\n", ["is not valid TOML"]),
        ("join = 3\n", ["[join] must be a table"]),
        ("[joiner]\nstage = 1\n", ["[joiner] is no table of bootstrap, join, up"]),
        ('stage = 1\nport = "abc"\n', ["--port", "abc"]),
    ],
)
def test_a_bad_file_is_a_one_line_usage_error(tmp_path: Path, text: str, words: list[str]) -> None:
    error = the_error(*invoke("join", "--config", write(tmp_path, text)))
    assert all(word in error for word in words), error
    if "port" not in text:
        assert "swarm.toml" in error


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    error = the_error(*invoke("join", "--config", str(tmp_path / "none.toml")))
    assert "none.toml" in error


@pytest.mark.parametrize("command", ["join", "bootstrap"])
def test_the_documented_samples_parse(tmp_path: Path, command: str) -> None:
    """docs/config.md's sample files set what they say (parsed as the command would, without running it)."""
    doc = (Path(__file__).parents[1] / "docs" / "config.md").read_text()
    samples = [block.split("```", 1)[0] for block in doc.split("```toml\n")[1:]]
    sample = next(text for text in samples if f"[{command}]" in text)
    config = write(tmp_path, sample)
    group = main.make_context("swarmnode", [command], resilient_parsing=True)
    ctx = main.commands[command].make_context(command, ["--config", config], parent=group)
    assert ctx.params["run_id"] == "swarm"
    if command == "join":
        assert (ctx.params["stage"], ctx.params["dtype"], ctx.params["threads"]) == ("auto", "bfloat16", 4)
        assert (
            ctx.params["run_owners"] == ("12D3KooWExampleBootstrapPeerId",) and ctx.params["public"] is True
        )
    else:
        assert (ctx.params["preset"], ctx.params["stages"], ctx.params["port"]) == ("llama-124m", 4, 31337)
        assert ctx.params["checkfree_plus"] is True and ctx.params["noloco_every"] == 50
