"""hivemind's DHT and libp2p parts, without the rest of its package.

Importing any hivemind module first runs the package's `__init__`, which imports every subpackage: its
averager brings scipy.optimize, its MoE and optimizer their own modules (0.3-0.5 s of each process's start on
a 2-core machine, `python -X importtime`). swarmnode uses only `hivemind.dht`, `hivemind.p2p`,
`hivemind.utils` and `hivemind.proto`, imported by their full names. `register_package`, called where a
program starts, registers the package without running its `__init__`, so that those submodules load alone.
A program that imported hivemind before keeps it whole: then this does nothing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator, Mapping


def register_package() -> None:
    """Make `import hivemind.<part>` load only that part (and what it imports), not the whole package."""
    if "hivemind" in sys.modules:
        return
    spec = importlib.util.find_spec("hivemind")
    if spec is None or spec.submodule_search_locations is None:
        return  # not installed: the first hivemind import says so
    sys.modules["hivemind"] = importlib.util.module_from_spec(spec)


@contextlib.contextmanager
def p2pd_flags(flags: Mapping[str, bool | int | str]) -> Iterator[None]:
    """p2pd processes that hivemind starts inside this block (in any thread of this process, such as the
    DHT's) also get `-NAME=VALUE` for each of `flags`.

    hivemind's `P2P.create` passes p2pd a fixed set of flags, and no way to add one; swarmnode needs
    `-relayDiscovery=0` (`dht.Reach.p2pd_flags`). Nothing changes for an empty `flags`."""
    if not flags:
        yield
        return
    from hivemind.p2p.p2p_daemon import P2P

    original = P2P.__dict__["_make_process_args"]

    def with_flags(*args: object, **kwargs: object) -> list[str]:
        return original.__func__(*args, **{**kwargs, **flags})

    P2P._make_process_args = staticmethod(with_flags)  # type: ignore[method-assign]
    try:
        yield
    finally:
        P2P._make_process_args = original  # type: ignore[method-assign]
