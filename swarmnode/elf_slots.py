"""Point a function that a loaded shared library imports at another: the library's slots for it in its global
offset table, found from its dynamic relocations.

ELF64 little-endian libraries on x86-64 and AArch64, loaded with their imports bound at load time (`dlopen`
with RTLD_NOW, as CPython loads extension modules): each slot then holds the function's address, which
`redirect` checks before it writes. It serves `malloc_tuning.stop_protobuf_trims`: a third-party extension
calls a C library function that swarmnode must keep it from calling, and no setting turns the call off.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from pathlib import Path

ELF_MAGIC = b"\x7fELF"
SHT_RELA, SHT_DYNSYM = 4, 11
# The relocations that fill a slot with a function's address (JUMP_SLOT, GLOB_DAT), by machine.
SLOT_RELOCATIONS = {62: (7, 6), 183: (1026, 1025)}  # EM_X86_64, EM_AARCH64
RELA_SIZE = 24
PROT_READ, PROT_WRITE = 1, 2


class SlotError(Exception):
    """The library is not one `redirect` can change, or a slot does not hold what it should."""


@dataclass(frozen=True)
class Section:
    type: int
    offset: int
    size: int
    link: int
    entsize: int


@dataclass(frozen=True)
class Imports:
    """What `redirect` needs of a library file: the link-time addresses of its slots for one function, and
    the link-time value of a function it defines (its load address locates the library in memory)."""

    slots: tuple[int, ...]
    anchor_value: int


def read_imports(data: bytes, symbol: str, anchor: str) -> Imports:
    """The slots that `data` (an ELF file's bytes) binds to `symbol`, and the value of its symbol `anchor`.
    SlotError for another format or machine, or for an `anchor` it does not define."""
    if data[:4] != ELF_MAGIC or data[4:6] != b"\x02\x01":
        raise SlotError("not a 64-bit little-endian ELF file")
    machine = struct.unpack_from("<H", data, 18)[0]
    if machine not in SLOT_RELOCATIONS:
        raise SlotError(f"ELF machine {machine} is neither x86-64 nor AArch64")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for index in range(shnum):
        _, kind, _, _, offset, size, link, _, _, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", data, shoff + index * shentsize
        )
        sections.append(Section(kind, offset, size, link, entsize))
    slots, anchors = [], []
    for section in sections:
        if section.type == SHT_DYNSYM:
            anchors += [value for name, value in _symbols(data, sections, section) if name == anchor]
        if section.type != SHT_RELA or sections[section.link].type != SHT_DYNSYM:
            continue
        names = [name for name, _ in _symbols(data, sections, sections[section.link])]
        for at in range(section.offset, section.offset + section.size, RELA_SIZE):
            r_offset, r_info, _ = struct.unpack_from("<QQq", data, at)
            if r_info & 0xFFFFFFFF in SLOT_RELOCATIONS[machine] and names[r_info >> 32] == symbol:
                slots.append(r_offset)
    if not anchors:
        raise SlotError(f"the library defines no {anchor}")
    return Imports(tuple(slots), anchors[0])


def _symbols(data: bytes, sections: list[Section], table: Section) -> list[tuple[str, int]]:
    strings = sections[table.link].offset
    symbols = []
    for at in range(table.offset, table.offset + table.size, table.entsize):
        st_name, _, _, _, st_value, _ = struct.unpack_from("<IBBHQQ", data, at)
        start = strings + st_name
        symbols.append((data[start : data.index(b"\0", start)].decode(errors="replace"), st_value))
    return symbols


def redirect(library: Path, symbol: str, anchor: str, original: int, replacement: int) -> int:
    """Point the loaded `library`'s slots for `symbol` at address `replacement`; how many. Every slot must
    hold `original` (else SlotError, and nothing is written). `anchor` is a function the library exports:
    the library lies at the anchor's address less its link-time value."""
    imports = read_imports(library.read_bytes(), symbol, anchor)
    loaded = ctypes.CDLL(str(library))  # the library as loaded already: `dlopen` finds the same object
    base = ctypes.cast(getattr(loaded, anchor), ctypes.c_void_p).value - imports.anchor_value
    addresses = [base + slot for slot in imports.slots]
    for address in addresses:
        if ctypes.c_void_p.from_address(address).value != original:
            raise SlotError(f"a slot of {library.name} for {symbol} does not hold the expected function")
    for address in addresses:
        _write_pointer(address, replacement)
    return len(addresses)


def _write_pointer(address: int, value: int) -> None:
    """Write a pointer into a mapped page, made writable for the write if it is read-only."""
    if _writable(address):
        ctypes.c_void_p.from_address(address).value = value
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.mprotect.restype = ctypes.c_int
    page_size = ctypes.CDLL(None).getpagesize()
    page = address - address % page_size
    if libc.mprotect(page, page_size, PROT_READ | PROT_WRITE) != 0:
        raise SlotError(f"mprotect failed: errno {ctypes.get_errno()}")
    try:
        ctypes.c_void_p.from_address(address).value = value
    finally:
        libc.mprotect(page, page_size, PROT_READ)


def _writable(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(bound, 16) for bound in span.split("-"))
            if start <= address < end:
                return "w" in perms
    raise SlotError(f"address {address:#x} is not mapped")
