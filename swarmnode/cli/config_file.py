"""`--config FILE`: a command's options from a TOML file; flags given on the command line override it.

Keys are option names without the leading dashes (`initial-peers`, `stage`, `device`; `_` works as `-`),
at the top level or under a table named after the command (`[join]`), which wins over the top level, so
one file can configure `bootstrap`, `join` and `up`: a top-level key applies to each of them that has that
option. Values are read as the flags' own types. A key no command knows, or one in a command's table that
it does not know, is a one-line usage error naming the file and the key.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., object])
COMMANDS = ("bootstrap", "join", "up")  # the tables a file may hold


def config_option(func: F) -> F:
    """Add `--config FILE` to a command: read before the other options, it sets their defaults."""
    return click.option(
        "--config",
        type=click.Path(dir_okay=False, path_type=Path),
        is_eager=True,
        expose_value=False,
        callback=_load,
        help="Read options from this TOML file (keys as the flags' names; flags given here override it).",
    )(func)


def _load(ctx: click.Context, param: click.Parameter, path: Path | None) -> None:
    if path is None:
        return
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as error:
        raise click.BadParameter(f"cannot read {path}: {error.strerror or error}", ctx, param) from None
    except tomllib.TOMLDecodeError as error:
        raise click.BadParameter(f"{path} is not valid TOML: {error}", ctx, param) from None
    name = ctx.info_name or ""
    section = raw.get(name, {})
    if not isinstance(section, dict):
        raise click.BadParameter(f"{path}: [{name}] must be a table", ctx, param)
    mine = _options(ctx.command)
    shared = {key: value for key, value in raw.items() if key not in COMMANDS and not isinstance(value, dict)}
    anyones = set().union(*(_options(command) for command in _siblings(ctx)))
    for key in shared:
        if _key(key) not in anyones:
            known = ", ".join(sorted(anyones))
            raise click.BadParameter(f"{path}: unknown key {key!r} (known: {known})", ctx, param)
    tables = [key for key, value in raw.items() if isinstance(value, dict) and key not in COMMANDS]
    if tables:
        raise click.BadParameter(f"{path}: [{tables[0]}] is no table of {', '.join(COMMANDS)}", ctx, param)
    values = {key: value for key, value in shared.items() if _key(key) in mine} | section
    ctx.default_map = {**(ctx.default_map or {}), **_defaults(ctx.command, values, path, ctx, param)}


def _key(key: str) -> str:
    return key.replace("_", "-")


def _options(command: click.Command | None) -> dict[str, click.Option]:
    """A command's options a file may set, by their long names without dashes."""
    if command is None:
        return {}
    return {
        opt.lstrip("-"): option
        for option in command.params
        if isinstance(option, click.Option) and option.name != "config" and not option.hidden
        for opt in option.opts
        if opt.startswith("--")
    }


def _siblings(ctx: click.Context) -> list[click.Command | None]:
    """The commands a file configures (this one alone when it runs outside the `swarmnode` group)."""
    parent = ctx.parent
    if parent is None or not isinstance(parent.command, click.Group):
        return [ctx.command]
    return [parent.command.get_command(parent, name) for name in COMMANDS]


def _defaults(
    command: click.Command, values: dict[str, Any], path: Path, ctx: click.Context, param: click.Parameter
) -> dict[str, Any]:
    """`values` keyed by the command's parameter names; unknown keys are errors."""
    options = _options(command)
    defaults = {}
    for key, value in values.items():
        option = options.get(_key(key))
        if option is None or option.name is None:
            known = ", ".join(sorted(options))
            raise click.BadParameter(
                f"{path}: unknown key {key!r} in [{ctx.info_name}] (known: {known})", ctx, param
            )
        if option.multiple and not isinstance(value, list):
            value = [value]
        if isinstance(value, list) and not option.multiple:
            raise click.BadParameter(f"{path}: {key!r} takes one value, not a list", ctx, param)
        defaults[option.name] = [str(v) for v in value] if option.multiple else _flag_text(value)
    return defaults


def _flag_text(value: Any) -> Any:
    """TOML values as a flag would give them (click converts them with the option's type)."""
    if isinstance(value, bool | int | float | str):
        return value
    return str(value)
