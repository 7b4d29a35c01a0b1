"""A daemon's events as lines for the volunteer who runs it (`join --human`, the default on a terminal):
what the node is, what it does every few steps, and what happens to it. `--json` prints every event as
a JSON object instead (`node.events`), for the launcher, log collectors and tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

Formatter = Callable[[Mapping[str, Any]], str]

PROGRESS_EVERY_STEPS = 10  # steps between a data node's step lines and a stage node's `progress` events


def _short(peer_id: object) -> str:
    return f"...{str(peer_id)[-8:]}"


def _number(value: object, digits: int = 3) -> str:
    return "-" if value is None else f"{float(value):.{digits}f}"  # type: ignore[arg-type]


def _step(f: Mapping[str, Any]) -> str:
    rate = f["tokens"] / f["seconds"] if f.get("seconds") else 0.0
    lost = f" | {f['lost']} microbatches lost" if f.get("lost") else ""
    return f"step {f['step']} | loss {_number(f['loss'])} | {rate:,.0f} tokens/s{lost}"


def _progress(f: Mapping[str, Any]) -> str:
    lost = f" | {f['lost']} dropped" if f["lost"] else ""
    return (
        f"stage {f['stage']} | step {f['step']} | outer step {f['outer_step']} | served {f['served']} "
        f"microbatches | {f['tokens_per_second']:,.0f} tokens/s busy{lost}"
    )


def _outer(f: Mapping[str, Any]) -> str:
    if f["paired"]:
        return f"outer step {f['outer_step']}: averaged with {_short(f.get('partner'))}"
    return f"outer step {f['outer_step']}: alone ({f.get('reason') or 'no partner'})"


def _finished(f: Mapping[str, Any]) -> str:
    return f"finished the run at step {f['step']}: validation loss {_number(f.get('val_loss'))}"


FORMATS: Mapping[str, Formatter] = {
    "online": lambda f: f"online: serving stage {f['stage']} as {_short(f['peer_id'])}",
    "step": _step,
    "progress": _progress,
    "validation": lambda f: f"validation loss {f['val_loss']:.3f} at step {f['step']}",
    "outer_step": _outer,
    "recovered": lambda f: f"stage {f['stage']} recovered by {f['method']} in {f['seconds']:.1f} s",
    "moving": lambda f: f"moving from stage {f['from_stage']} to stage {f['to_stage']}, which lost its nodes",
    "rejected": lambda f: f"refused {_short(f['peer_id'])}: {f['code']}: {f['reason']}",
    "metrics": lambda f: f"metrics at {f['url']}",
    "finished": _finished,
}


class HumanLines:
    """Which events a volunteer sees, and how: a data node's step every `every_steps` steps, every event
    else that `FORMATS` has (a stage node's `progress` comes every `PROGRESS_EVERY_STEPS` steps); the rest
    (joining phases, snapshots, microbatch losses) only in `--json`."""

    def __init__(self, every_steps: int) -> None:
        if every_steps < 1:
            raise ValueError(f"every_steps must be at least 1, got {every_steps}")
        self.every_steps = every_steps

    def line(self, event: str, fields: Mapping[str, Any], now: float) -> str | None:
        """The line for `event`, stamped with the local time of `now`, or None if it is not shown."""
        formatter = FORMATS.get(event)
        if formatter is None or (event == "step" and fields["step"] % self.every_steps):
            return None
        return f"{time.strftime('%H:%M:%S', time.localtime(now))} {formatter(fields)}"
