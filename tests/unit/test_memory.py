"""agent.memory: the mmap threshold is pinned (glibc's behaviour checked in a fresh process)
unless the operator set one."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from agent.memory import MMAP_THRESHOLD, operator_setting, pin_mmap_threshold

# Allocates a buffer above the threshold twice, freeing the first: glibc maps the first; with
# the dynamic threshold the free raises it, and the second comes from the heap (what made the
# soak's RSS creep); pinned, the second is mapped too. Prints the mapped chunks (hblks)
# while the second is alive.
PROBE = textwrap.dedent(
    """
    import ctypes, sys
    from agent.memory import pin_mmap_threshold

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Mallinfo2
    if sys.argv[1] == "pin":
        print(pin_mmap_threshold({}), file=sys.stderr)
    malloc, free = libc.malloc, libc.free
    malloc.restype, malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    free.argtypes = (ctypes.c_void_p,)
    base = libc.mallinfo2().hblks
    first = malloc(256 * 1024)
    free(first)
    second = malloc(256 * 1024)
    print(libc.mallinfo2().hblks - base)
    free(second)
    """
)


def mapped_chunks(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return int(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc behaviour")
def test_pinned_threshold_keeps_large_buffers_out_of_the_heap() -> None:
    assert mapped_chunks("dynamic") == 0  # glibc raised the threshold: from the heap
    assert mapped_chunks("pin") == 1


def test_operator_setting_wins() -> None:
    assert operator_setting({"MALLOC_MMAP_THRESHOLD_": "65536"}) == "MALLOC_MMAP_THRESHOLD_=65536"
    tunables = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=1000"}
    assert operator_setting(tunables) == "GLIBC_TUNABLES glibc.malloc.mmap_threshold=1000"
    assert operator_setting({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) is None
    assert "kept the operator's" in pin_mmap_threshold({"MALLOC_MMAP_THRESHOLD_": "1"})


def test_pin_reports_what_it_did() -> None:
    assert pin_mmap_threshold({}) == f"malloc mmap threshold fixed at {MMAP_THRESHOLD} bytes"


# Frees 40 MB of small heap chunks with one chunk kept after each megabyte (the heap cannot
# shrink from its top), then prints the resident MB before and after release_free_memory.
TRIM_PROBE = textwrap.dedent(
    """
    import ctypes
    from agent.memory import pin_mmap_threshold, release_free_memory

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    pin_mmap_threshold({})
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = (ctypes.c_void_p,)
    chunks = [libc.malloc(16 * 1024) for _ in range(2560)]
    for chunk in chunks:
        ctypes.memset(chunk, 1, 16 * 1024)
    for index, chunk in enumerate(chunks):
        if index % 64 != 63:
            libc.free(chunk)
    before = rss()
    print(release_free_memory(), before, rss())
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc_trim")
def test_release_free_memory_returns_free_heap_pages() -> None:
    """Free pages between chunks in use go back to the system (malloc_trim), not only the
    heap's top."""
    done = subprocess.run(
        [sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    released, before, after = done.stdout.split()
    assert released == "True"
    assert float(before) - float(after) > 20, done.stdout


def test_settle_heap_freezes_what_start_up_left_alive() -> None:
    """Objects alive at the end of start-up go to the permanent generation (full collections
    skip them); garbage cycles start-up left are collected first, not frozen."""
    import gc

    from agent.memory import settle_heap

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    Cycle()  # garbage: only the collector frees a cycle
    alive = Cycle()
    try:
        frozen = settle_heap()
        assert frozen == gc.get_freeze_count() > 0
        assert not any(type(o) is Cycle and o is not alive for o in gc.get_objects())
        # frozen: in no generation the collector walks
        assert not any(o is alive for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(o is alive for o in gc.get_objects())
