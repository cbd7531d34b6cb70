"""Keep a long-running agent's heap from creeping: pin glibc's mmap threshold, and give freed
memory back after a huge request.

Every socket read of asyncio's selector transports (the kubelet's gRPC connection, the API
server's HTTP connection) asks for a 256 KiB buffer and shrinks it to what arrived. glibc
serves an allocation that large with ``mmap`` only while its *dynamic* mmap threshold is
below it; the first such buffer freed raises the threshold above 256 KiB, and from then on
every read carves its buffer out of the main heap, where the small objects allocated in
between pin the top and the freed space cannot go back to the system. The soak
(``make soak``) measured this as RSS growing by steps of about 1.8 MB, some 2 MB per 1 000
prepare/unprepare cycles, with Python's own allocations flat (docs/RELIABILITY.md).

Setting ``M_MMAP_THRESHOLD`` explicitly turns the dynamic adjustment off (mallopt(3)): large
buffers are mapped and unmapped, which costs a pair of system calls per read and keeps the
heap flat. An operator's own choice wins: with ``MALLOC_MMAP_THRESHOLD_`` in the environment
or ``glibc.malloc.mmap_threshold`` in ``GLIBC_TUNABLES`` nothing is changed. On a C library
without ``mallopt`` (musl, macOS) nothing is changed either.

A huge request (thousands of claims in one NodePrepareResources) leaves tens of MB of the
main heap free but mapped: freed chunks between chunks still in use stay part of the heap,
which only ever shrinks from its top. :func:`release_free_memory` collects the reference
cycles such a request left (exceptions, their tracebacks and frames) and asks glibc to return
every free page (``malloc_trim(0)``: ``madvise(MADV_DONTNEED)`` on whole free pages, in every
arena). It costs milliseconds, so the kubelet surface calls it after large requests only.

Once started, the agent holds some hundred thousand long-lived objects (modules, the
generated protobuf classes, the inventory, the clients). Python's cyclic collector walks all
of them in every full collection, which a prepare triggers now and then (once in 60 batches
of 32 claims on the prepare benchmark): a pause of tens of milliseconds in that prepare (87 ms
measured on the 2-core VM). :func:`settle_heap`,
called once start-up is done, collects and then freezes what is alive (``gc.freeze``): the
collector leaves those objects alone from then on, as it should, since they live as long as
the process. Objects freed by reference counting are freed as before.

A leaf module: every layer may call it.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Mapping
from typing import Final

#: glibc's ``M_MMAP_THRESHOLD`` (malloc.h).
M_MMAP_THRESHOLD: Final = -3
#: glibc's default starting threshold, kept fixed (the dynamic one may rise to 32 MiB).
MMAP_THRESHOLD: Final = 128 * 1024


def operator_setting(environ: Mapping[str, str]) -> str | None:
    """The environment's own mmap threshold setting, as text for the log; None if none."""
    if "MALLOC_MMAP_THRESHOLD_" in environ:
        return f"MALLOC_MMAP_THRESHOLD_={environ['MALLOC_MMAP_THRESHOLD_']}"
    tunables = environ.get("GLIBC_TUNABLES", "")
    for item in tunables.replace(":", " ").split():
        if item.startswith("glibc.malloc.mmap_threshold="):
            return f"GLIBC_TUNABLES {item}"
    return None


def pin_mmap_threshold(environ: Mapping[str, str], threshold: int = MMAP_THRESHOLD) -> str:
    """Fix the mmap threshold at ``threshold`` unless the environment sets one; returns what
    was done, for the startup log."""
    own = operator_setting(environ)
    if own is not None:
        return f"kept the operator's malloc mmap threshold ({own})"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return "malloc mmap threshold left as is (no mallopt in this C library)"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        return "malloc mmap threshold left as is (mallopt refused it)"
    return f"malloc mmap threshold fixed at {threshold} bytes"


def release_free_memory() -> bool:
    """Collect garbage, then return the C heap's free pages to the system (glibc's
    ``malloc_trim``); False where the C library has no ``malloc_trim`` (only the collection
    was done)."""
    gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    trim(0)
    return True


def settle_heap() -> int:
    """After start-up: collect the garbage start-up left, then move every object alive into
    the collector's permanent generation (``gc.freeze``); returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
