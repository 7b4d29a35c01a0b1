"""Point a function that a loaded shared library imports at another: the library's slots for it in its global
offset table, found from its dynamic relocations.

ELF64 little-endian libraries on x86-64 and AArch64, loaded with their imports bound at load time (`dlopen`
with RTLD_NOW, as CPython loads extension modules): each slot then holds the function's address. Nothing is
read from or written to memory before the loaded library is shown to be the file read (its mappings in
`/proc/self/maps` carry the file's inode) and every slot to lie in them and to hold the expected function.
It serves `malloc_tuning.stop_protobuf_trims`: a third-party extension calls a C library function that
swarmnode must keep it from calling, and no setting turns the call off.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

ELF_MAGIC = b"\x7fELF"
SHT_RELA, SHT_DYNSYM = 4, 11
SHN_UNDEF = 0
# The relocations that fill a slot with a function's address (JUMP_SLOT, GLOB_DAT), by machine.
SLOT_RELOCATIONS = {62: (7, 6), 183: (1026, 1025)}  # EM_X86_64, EM_AARCH64
SYM_SIZE, RELA_SIZE = 24, 24


class SlotError(Exception):
    """The library is not one this module can change, or a slot does not hold what it should."""


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


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    perms: str


def read_imports(data: bytes, symbol: str, anchor: str) -> Imports:
    """The slots that `data` (an ELF file's bytes) binds to `symbol`, and the value of the function `anchor`
    it defines. SlotError for another format or machine, a malformed file, or an `anchor` it does not
    define."""
    if data[:4] != ELF_MAGIC or data[4:6] != b"\x02\x01":
        raise SlotError("not a 64-bit little-endian ELF file")
    try:
        return _read_imports(data, symbol, anchor)
    except (struct.error, IndexError, ValueError, UnicodeDecodeError) as error:
        raise SlotError(f"malformed ELF file: {type(error).__name__}: {error}") from None


def _read_imports(data: bytes, symbol: str, anchor: str) -> Imports:
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
            anchors += [
                value
                for name, value, defined in _symbols(data, sections, section)
                if name == anchor and defined
            ]
        if section.type != SHT_RELA or sections[section.link].type != SHT_DYNSYM:
            continue
        if section.entsize != RELA_SIZE:
            raise ValueError(f"relocation entries of {section.entsize} bytes")
        names = [name for name, _, _ in _symbols(data, sections, sections[section.link])]
        for at in range(section.offset, section.offset + section.size, RELA_SIZE):
            r_offset, r_info, _ = struct.unpack_from("<QQq", data, at)
            if r_info & 0xFFFFFFFF in SLOT_RELOCATIONS[machine] and names[r_info >> 32] == symbol:
                slots.append(r_offset)
    if not anchors:
        raise SlotError(f"the library defines no {anchor}")
    return Imports(tuple(slots), anchors[0])


def _symbols(data: bytes, sections: list[Section], table: Section) -> list[tuple[str, int, bool]]:
    """Each symbol of a symbol table: its name, value, and whether the library defines it."""
    if table.entsize != SYM_SIZE:
        raise ValueError(f"symbol entries of {table.entsize} bytes")
    strings = sections[table.link].offset
    symbols = []
    for at in range(table.offset, table.offset + table.size, SYM_SIZE):
        st_name, _, _, st_shndx, st_value, _ = struct.unpack_from("<IBBHQQ", data, at)
        start = strings + st_name
        name = data[start : data.index(b"\0", start)].decode()
        symbols.append((name, st_value, st_shndx != SHN_UNDEF))
    return symbols


def slot_addresses(library: Path, symbol: str, anchor: str) -> list[tuple[int, Mapping]]:
    """Where the loaded `library`'s slots for `symbol` are, each with the mapping that holds it. SlotError
    unless the library is loaded from this very file (not one replaced on disk since) and every slot and the
    anchor lie in its mappings."""
    imports = read_imports(library.read_bytes(), symbol, anchor)
    mappings = _mappings_of(library)
    loaded = ctypes.CDLL(str(library))  # the library as loaded already: `dlopen` finds the same object
    anchor_address = ctypes.cast(getattr(loaded, anchor), ctypes.c_void_p).value or 0
    if _holding(mappings, anchor_address) is None:
        raise SlotError(f"{anchor} of {library.name} lies outside the file's mappings")
    base = anchor_address - imports.anchor_value
    found = []
    for slot in imports.slots:
        mapping = _holding(mappings, base + slot)
        if mapping is None:
            raise SlotError(f"a slot of {library.name} for {symbol} lies outside the file's mappings")
        found.append((base + slot, mapping))
    return found


def slot_values(library: Path, symbol: str, anchor: str) -> list[int | None]:
    """What the loaded `library`'s slots for `symbol` hold now."""
    return [
        ctypes.c_void_p.from_address(address).value for address, _ in slot_addresses(library, symbol, anchor)
    ]


def redirect(library: Path, symbol: str, anchor: str, original: int, replacement: int) -> int:
    """Point the loaded `library`'s slots for `symbol` at address `replacement`; how many. Every slot must
    hold `original`, else SlotError and nothing is written. `anchor` is a function the library exports: the
    library lies at the anchor's address less its link-time value."""
    slots = slot_addresses(library, symbol, anchor)
    for address, _ in slots:
        if ctypes.c_void_p.from_address(address).value != original:
            raise SlotError(f"a slot of {library.name} for {symbol} does not hold the expected function")
    for address, mapping in slots:
        _write_pointer(address, replacement, mapping)
    return len(slots)


def _write_pointer(address: int, value: int, mapping: Mapping) -> None:
    """Write a pointer into a mapped page, made writable for the write if it is not, then as it was."""
    if "w" in mapping.perms:
        ctypes.c_void_p.from_address(address).value = value
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.mprotect.restype = ctypes.c_int
    page = address - address % mmap.PAGESIZE
    was = (mmap.PROT_READ if "r" in mapping.perms else 0) | (mmap.PROT_EXEC if "x" in mapping.perms else 0)
    if libc.mprotect(page, mmap.PAGESIZE, was | mmap.PROT_WRITE) != 0:
        raise SlotError(f"mprotect failed: {os.strerror(ctypes.get_errno())}")
    try:
        ctypes.c_void_p.from_address(address).value = value
    finally:
        libc.mprotect(page, mmap.PAGESIZE, was)


def _mappings_of(library: Path) -> list[Mapping]:
    """The mappings of this process that hold `library`'s file (by path and inode)."""
    path, inode = os.path.realpath(library), os.stat(library).st_ino
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == path and int(fields[4]) == inode:
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                found.append(Mapping(start, end, fields[1]))
    if not found:
        raise SlotError(f"{library.name} is not loaded from {path} (replaced on disk since?)")
    return found


def _holding(mappings: list[Mapping], address: int) -> Mapping | None:
    """The mapping that holds the 8 bytes at `address`, if one does."""
    return next((m for m in mappings if m.start <= address and address + 8 <= m.end), None)
