"""hivemind's DHT and libp2p parts, without the rest of its package.

Importing any hivemind module first runs the package's `__init__`, which imports every subpackage: its
averager brings scipy.optimize, its MoE and optimizer their own modules (0.3-0.5 s of each process's start on
a 2-core machine, `python -X importtime`). swarmnode uses only `hivemind.dht`, `hivemind.p2p`,
`hivemind.utils` and `hivemind.proto`, imported by their full names. `register_package`, called where a
program starts, registers the package without running its `__init__`, so that those submodules load alone.
A program that imported hivemind before keeps it whole: then this does nothing.
"""

from __future__ import annotations

import importlib.util
import sys


def register_package() -> None:
    """Make `import hivemind.<part>` load only that part (and what it imports), not the whole package."""
    if "hivemind" in sys.modules:
        return
    spec = importlib.util.find_spec("hivemind")
    if spec is None or spec.submodule_search_locations is None:
        return  # not installed: the first hivemind import says so
    sys.modules["hivemind"] = importlib.util.module_from_spec(spec)
