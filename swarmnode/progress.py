"""Progress bars (tqdm, on stderr) for the slow steps of preparing data: tokenizer training, encoding.

Shown when stderr is a terminal, or when asked with `SWARMNODE_PROGRESS=1` (`0` hides them everywhere).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")
ENV = "SWARMNODE_PROGRESS"


def enabled() -> bool:
    """Whether bars are shown: `$SWARMNODE_PROGRESS` if set (1 or 0), else whether stderr is a terminal."""
    asked = os.environ.get(ENV, "").strip()
    if asked in ("0", "1"):
        return asked == "1"
    return sys.stderr.isatty()


def progress(items: Iterable[T], description: str, unit: str, total: int | None = None) -> Iterator[T]:
    """`items`, counted by a bar on stderr while they are consumed (when `enabled`)."""
    if not enabled():
        yield from items
        return
    with tqdm(items, desc=description, unit=unit, total=total, file=sys.stderr, dynamic_ncols=True) as bar:
        yield from bar
