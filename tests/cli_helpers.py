"""Running the `swarmnode` CLI in-process in tests, and checking its one-line usage errors."""

from __future__ import annotations

from click.testing import CliRunner

from swarmnode.cli import main


def run(*args: str) -> tuple[int, str]:
    """`swarmnode ARGS` in this process: the exit code and everything it printed."""
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def one_line_usage_error(code: int, output: str, *expected: str) -> None:
    """A usage error (exit 2) of exactly one `Error:` line holding every `expected` text, no traceback."""
    assert code == 2 and "Traceback" not in output, output
    error = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and all(text in error[0] for text in expected), output
