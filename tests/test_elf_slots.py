"""`elf_slots`: a loaded library's slots for an imported function, read from the file and checked in memory
before anything is written."""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import pytest

from swarmnode.elf_slots import SlotError, read_imports, redirect

upb = pytest.importorskip("google._upb._message", reason="protobuf's upb build")
LIBRARY = Path(upb.__file__)


def _trim() -> int | None:
    return ctypes.cast(ctypes.CDLL(None).malloc_trim, ctypes.c_void_p).value


def _slot_values() -> list[int | None]:
    """What the upb extension's slots for `malloc_trim` hold now."""
    imports = read_imports(LIBRARY.read_bytes(), "malloc_trim", "PyInit__message")
    anchor = ctypes.cast(ctypes.CDLL(str(LIBRARY)).PyInit__message, ctypes.c_void_p).value
    base = anchor - imports.anchor_value
    return [ctypes.c_void_p.from_address(base + slot).value for slot in imports.slots]


def test_the_upb_extension_imports_malloc_trim_through_a_slot() -> None:
    values = _slot_values()
    assert values and values == [_trim()] * len(values)  # bound at load: each holds the C library's function


def test_a_function_it_does_not_import_has_no_slots() -> None:
    assert read_imports(LIBRARY.read_bytes(), "no_such_function", "PyInit__message").slots == ()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"#!/bin/sh\n", "not a 64-bit little-endian ELF"),
        (b"\x7fELF\x01\x01" + bytes(58), "not a 64-bit little-endian ELF"),
        (b"\x7fELF\x02\x01" + bytes(12) + struct.pack("<H", 40) + bytes(44), "neither x86-64 nor AArch64"),
    ],
)
def test_other_files_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(SlotError, match=match):
        read_imports(data, "malloc_trim", "PyInit__message")


def test_an_anchor_the_library_does_not_define_is_refused() -> None:
    with pytest.raises(SlotError, match="defines no"):
        read_imports(LIBRARY.read_bytes(), "malloc_trim", "no_such_anchor")


def test_a_slot_holding_another_function_is_left_as_it_is() -> None:
    trim = _trim()
    assert trim is not None
    with pytest.raises(SlotError, match="does not hold the expected function"):
        redirect(LIBRARY, "malloc_trim", "PyInit__message", original=trim + 16, replacement=trim + 32)
    assert _slot_values() == [trim] * len(_slot_values())
