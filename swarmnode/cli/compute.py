"""`--device` and `--dtype`, shared by `train`, `bootstrap`, `join` and `up` (light: torch loads only when
a device is checked)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click

from swarmnode.runspec import COMPUTE_DTYPE_NAMES

F = TypeVar("F", bound=Callable[..., object])


def device_option(func: F) -> F:
    """`--device`: where this process computes (each volunteer's own choice, whatever the run's)."""
    return click.option(
        "--device",
        default="auto",
        show_default=True,
        metavar="DEVICE",
        help="Where to compute: auto, cpu, cuda, cuda:N or mps (auto: CUDA when present, else the CPU).",
    )(func)


def dtype_option(help_text: str, default: str | None = None) -> Callable[[F], F]:
    """`--dtype`: a compute precision (weights stay float32 whatever it is)."""
    return click.option(
        "--dtype",
        type=click.Choice(COMPUTE_DTYPE_NAMES),
        default=default,
        show_default=default is not None,
        help=help_text,
    )


def device_or_fail(name: str) -> str:
    """A `--device` this machine has, checked before anything starts."""
    from swarmnode.precision import PrecisionError, resolve_device

    try:
        resolve_device(name)
    except PrecisionError as error:
        raise click.BadParameter(str(error), param_hint="--device") from None
    return name
