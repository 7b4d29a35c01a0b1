"""`-v`, `--log-level` and `--log-file` for the long-running commands: where a daemon's log lines go.

Event lines (one JSON object per line, `node.events`) always go to stdout; these options govern the log
records of swarmnode's own modules (and hivemind's warnings at `info` and below).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])
LEVELS = ("debug", "info", "warning", "error")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def logging_options(func: F) -> F:
    """Add `-v/--verbose`, `--log-level` and `--log-file` to a command; logging is set up before it runs."""

    @functools.wraps(func)
    def configured(
        *args: Any, verbose: bool, log_level: str | None, log_file: Path | None, **kwargs: Any
    ) -> Any:
        configure(log_level or ("info" if verbose else "warning"), log_file)
        return func(*args, **kwargs)

    for option in (
        click.option(
            "--log-file",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help="Append log lines to this file instead of stderr (event lines stay on stdout).",
        ),
        click.option(
            "--log-level",
            type=click.Choice(LEVELS),
            default=None,
            help="Log level of swarmnode's own log lines (default: warning; -v: info).",
        ),
        click.option(
            "-v", "--verbose", is_flag=True, help="Log at info level, hivemind's warnings included."
        ),
    ):
        configured = option(configured)
    return configured  # type: ignore[return-value]


def configure(level: str, path: Path | None) -> None:
    """Log at `level` to stderr, or appended to `path` (a one-line usage error if it cannot be written)."""
    numeric = getattr(logging, level.upper())
    if path is not None:
        try:
            handler: logging.Handler = logging.FileHandler(path, mode="a", encoding="utf-8")
        except OSError as error:
            raise click.BadParameter(
                f"cannot write {path}: {error.strerror or error}", param_hint="--log-file"
            ) from None
    else:
        handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.basicConfig(level=numeric, handlers=[handler], force=True)
    logging.getLogger("hivemind").setLevel(numeric if numeric < logging.WARNING else logging.ERROR)
