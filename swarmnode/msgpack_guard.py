"""A depth limit for hivemind's msgpack extension types, which otherwise let ~700 peer bytes crash a process.

`MSGPackSerializer` decodes its extension types (tuples, DHT dictionaries) by calling msgpack again from
inside msgpack's `ext_hook`. Each level puts a whole msgpack unpacker context on the C stack, so a tuple
nested 200 deep overflows it: a segfault, not an exception, before any validator sees the value. Peer bytes
reach that decoder in hivemind's own `rpc_store` and `rpc_find` and in our record validators.

`install()` replaces the extension decoder with one that counts nesting per thread and raises
`NestingTooDeep` past `MAX_EXT_DEPTH`; hivemind's handlers turn that into a failed request. It must run
before the DHT starts (`SwarmDHT` does it), so hivemind's handlers use it too.
"""

from __future__ import annotations

import threading
from typing import Any

from hivemind.utils import MSGPackSerializer

MAX_EXT_DEPTH = 16  # hivemind nests 3 deep (a dictionary value of tuples); 16 levels need well under 1 MiB

_depth = threading.local()


class NestingTooDeep(ValueError):
    """A msgpack value nests extension types deeper than `MAX_EXT_DEPTH`."""


_unguarded = MSGPackSerializer._decode_ext_types.__func__


def _decode_ext_types(cls: type[MSGPackSerializer], type_code: int, data: bytes) -> Any:
    level = getattr(_depth, "level", 0)
    if level >= MAX_EXT_DEPTH:
        raise NestingTooDeep(f"msgpack extension types nested deeper than {MAX_EXT_DEPTH}")
    _depth.level = level + 1
    try:
        return _unguarded(cls, type_code, data)
    finally:
        _depth.level = level


def install() -> None:
    """Make `MSGPackSerializer` (in this process and any it forks later) refuse deep nesting. Idempotent."""
    MSGPackSerializer._decode_ext_types = classmethod(_decode_ext_types)


def installed() -> bool:
    return MSGPackSerializer._decode_ext_types.__func__ is _decode_ext_types
