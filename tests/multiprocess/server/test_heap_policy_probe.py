"""The server's C heap policy: large freed blocks go back to the operating system (measured
in a fresh interpreter per probe)."""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys
from pathlib import Path

import pytest

from server.heap_policy import MMAP_THRESHOLD_BYTES

LIBC = ctypes.CDLL(ctypes.util.find_library("c"))

#: Run in a fresh interpreter: in this one an earlier test may have left a free chunk in the
#: heap big enough to serve the probe (malloc maps a block only when its arenas must grow).
PROBE = """
import ctypes, ctypes.util, sys
from server.heap_policy import MMAP_THRESHOLD_BYTES, return_large_blocks

FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"

class MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS.split()]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "policy":
    assert return_large_blocks()
# glibc's own policy raises its threshold to 24 MiB here, and serves the next block from an
# arena, where it stays resident once freed.
libc.free(libc.malloc(24 << 20))
before = libc.mallinfo2().hblkhd
block = libc.malloc(4 * MMAP_THRESHOLD_BYTES)
mapped = libc.mallinfo2().hblkhd - before
libc.free(block)
print(mapped, libc.mallinfo2().hblkhd - before)
"""


def _probe(*args: str) -> tuple[int, int]:
    """(bytes mapped for a 4 MiB block after a 24 MiB one was freed, bytes still mapped once
    it is freed too), in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        cwd=Path(__file__).resolve().parents[3],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return int(out[0]), int(out[1])


@pytest.mark.skipif(not hasattr(LIBC, "mallinfo2"), reason="not glibc >= 2.33")
def test_a_block_over_the_threshold_is_mapped_after_a_larger_one_was_freed() -> None:
    mapped, left = _probe("policy")
    assert mapped >= 4 * MMAP_THRESHOLD_BYTES
    assert left == 0  # unmapped when freed
    assert _probe("default")[0] == 0  # what the policy changes: glibc's own maps nothing
