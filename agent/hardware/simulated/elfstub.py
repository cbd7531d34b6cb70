"""Stand-ins for the driver's shared libraries on a simulated host: tiny ELF shared objects.

A container runtime's loader cache (``ldconfig``) lists a library only if the file is an ELF
shared object and names its soname in its dynamic section; a text file is skipped. So the
simulated driver root holds, for each library, a 64-bit little-endian ``ET_DYN`` object of a
few hundred bytes: one ``PT_LOAD`` segment covering the file, a ``PT_DYNAMIC`` segment with
``DT_STRTAB``, ``DT_STRSZ`` and ``DT_SONAME``. No code and no symbols: nothing can load it to
run (the simulated NVML lives below pynvml, ``agent.hardware.simulated.install``), but
``ldconfig`` and ``readelf -d`` read its soname as they read a real driver's.
"""

from __future__ import annotations

import struct

EM_X86_64 = 62
_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")  # Elf64_Ehdr
_PROGRAM = struct.Struct("<IIQQQQQQ")  # Elf64_Phdr
_DYN = struct.Struct("<qQ")  # Elf64_Dyn
ET_DYN, PT_LOAD, PT_DYNAMIC, PF_R = 3, 1, 2, 4
DT_NULL, DT_STRTAB, DT_STRSZ, DT_SONAME = 0, 5, 10, 14


def shared_object(soname: str, machine: int = EM_X86_64) -> bytes:
    """The bytes of an ELF64 shared object whose ``DT_SONAME`` is ``soname``."""
    strings = b"\0" + soname.encode() + b"\0"
    program_headers = 2
    strings_at = _HEADER.size + program_headers * _PROGRAM.size
    dynamic_at = (strings_at + len(strings) + 7) & ~7  # Elf64_Dyn is 8-byte aligned
    dynamic = b"".join(
        _DYN.pack(tag, value)
        for tag, value in (
            (DT_STRTAB, strings_at),  # an address: the one segment maps the file at 0
            (DT_STRSZ, len(strings)),
            (DT_SONAME, 1),
            (DT_NULL, 0),
        )
    )
    size = dynamic_at + len(dynamic)
    ident = b"\x7fELF" + bytes((2, 1, 1))  # ELFCLASS64, ELFDATA2LSB, EV_CURRENT
    header = _HEADER.pack(
        ident, ET_DYN, machine, 1, 0, _HEADER.size, 0, 0, _HEADER.size, _PROGRAM.size,
        program_headers, 64, 0, 0,
    )  # fmt: skip
    load = _PROGRAM.pack(PT_LOAD, PF_R, 0, 0, 0, size, size, 0x1000)
    dyn = _PROGRAM.pack(
        PT_DYNAMIC, PF_R, dynamic_at, dynamic_at, dynamic_at, len(dynamic), len(dynamic), 8
    )
    head = header + load + dyn + strings
    return head + bytes(dynamic_at - len(head)) + dynamic
