"""`elf_slots`: a loaded library's slots for an imported function, read from the file and checked in memory
before anything is written."""

from __future__ import annotations

import ctypes
import mmap
import struct
from pathlib import Path

import pytest

from swarmnode.elf_slots import SlotError, read_imports, redirect, slot_values

upb = pytest.importorskip("google._upb._message", reason="protobuf's upb build")
LIBRARY = Path(upb.__file__)


def _address(function: str) -> int | None:
    return ctypes.cast(getattr(ctypes.CDLL(None), function), ctypes.c_void_p).value


def test_the_upb_extension_imports_free_through_a_slot_bound_at_load() -> None:
    values = slot_values(LIBRARY, "free", "PyInit__message")
    assert values and values == [_address("free")] * len(values)


def test_a_function_it_does_not_import_has_no_slots() -> None:
    assert read_imports(LIBRARY.read_bytes(), "no_such_function", "PyInit__message").slots == ()


def _header(machine: int, shoff: int = 0, shentsize: int = 64, shnum: int = 0) -> bytes:
    """An ELF64 little-endian header of `machine` whose section table is at `shoff`."""
    return (
        b"\x7fELF\x02\x01"
        + bytes(12)
        + struct.pack("<H", machine)
        + bytes(0x28 - 20)
        + struct.pack("<Q", shoff)
        + bytes(0x3A - 0x30)
        + struct.pack("<HH", shentsize, shnum)
        + bytes(64 - 0x3E)
    )


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"#!/bin/sh\n", "not a 64-bit little-endian ELF"),
        (b"\x7fELF\x01\x01" + bytes(58), "not a 64-bit little-endian ELF"),
        (_header(40), "neither x86-64 nor AArch64"),
        (_header(62)[:30], "malformed ELF file"),  # cut short
        (_header(62, shoff=1 << 20, shnum=3), "malformed ELF file"),  # sections past its end
        (_header(62), "defines no PyInit__message"),  # no sections at all
    ],
)
def test_other_files_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(SlotError, match=match):
        read_imports(data, "malloc_trim", "PyInit__message")


def test_a_symbol_table_of_another_entry_size_is_refused() -> None:
    # two sections: a symbol table (type 11) whose entries claim 0 bytes, linked to section 0
    table = struct.pack("<IIQQQQIIQQ", 0, 11, 0, 0, 0, 24, 0, 0, 0, 0)
    data = _header(62, shoff=64, shnum=2) + bytes(64) + table
    with pytest.raises(SlotError, match="malformed ELF file: ValueError: symbol entries of 0 bytes"):
        read_imports(data, "malloc_trim", "PyInit__message")


def test_an_anchor_the_library_does_not_define_is_refused() -> None:
    with pytest.raises(SlotError, match="defines no"):
        read_imports(LIBRARY.read_bytes(), "malloc_trim", "no_such_anchor")
    with pytest.raises(SlotError, match="defines no"):  # one it only imports
        read_imports(LIBRARY.read_bytes(), "malloc_trim", "free")


def test_a_slot_holding_another_function_is_left_as_it_is() -> None:
    before = slot_values(LIBRARY, "free", "PyInit__message")
    wrong = (_address("free") or 0) + 16
    with pytest.raises(SlotError, match="does not hold the expected function"):
        redirect(LIBRARY, "free", "PyInit__message", original=wrong, replacement=wrong + 16)
    assert slot_values(LIBRARY, "free", "PyInit__message") == before


def test_a_read_only_page_is_written_and_left_read_only() -> None:
    from swarmnode.elf_slots import Mapping, _write_pointer

    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = mmap.mmap(-1, mmap.PAGESIZE)
    cell = ctypes.c_char.from_buffer(page)
    address = ctypes.addressof(cell)
    assert libc.mprotect(address, mmap.PAGESIZE, mmap.PROT_READ) == 0
    try:
        _write_pointer(address + 8, 0x1234, Mapping(address, address + mmap.PAGESIZE, "r--s"))
        assert ctypes.c_void_p.from_address(address + 8).value == 0x1234
        assert _perms(address).startswith("r--")  # as it was: read only
    finally:
        libc.mprotect(address, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE)
        del cell
        page.close()


def _perms(address: int) -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(bound, 16) for bound in span.split("-"))
            if start <= address < end:
                return perms
    raise LookupError(hex(address))
