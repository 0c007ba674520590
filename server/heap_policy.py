"""How the server's C heap gives large freed blocks back to the operating system.

glibc's malloc serves a block of at least its mmap threshold (128 KiB at start) with its own
`mmap`, unmapped when freed; smaller blocks come from arenas (the main heap, and one per thread
that allocates), whose freed space stays resident, reused by later allocations. The threshold
is dynamic: each time an mmapped block is freed, it rises to that block's size, up to 32 MiB.
A server frees many such blocks (a version's fetched blob bytes, its decode and packing
temporaries), so after the first ones every block under 32 MiB comes from an arena: the fetch
threads' arenas then keep, freed but resident, about as much as one version's biggest blobs
took at once. Bootstrapping the synthetic 1 GB model held as int4 (290 MiB of tables in two
copies), the server stayed about 100 MiB larger than its live blocks for the rest of its life.

`return_large_blocks` fixes the threshold at `MMAP_THRESHOLD_BYTES`, which turns the rising off:
a block of 1 MiB or more is always mapped and unmapped, so memory taken for a version goes back
when the version is written. Blocks that size are few (tables, blobs, batch temporaries of
thousands of rows), so the extra system calls and page faults cost nothing measurable.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Final

log = logging.getLogger(__name__)

#: blocks at least this large are mapped on their own and unmapped when freed.
MMAP_THRESHOLD_BYTES: Final = 1 << 20
#: glibc's mallopt parameter number (malloc.h).
_M_MMAP_THRESHOLD: Final = -3


def return_large_blocks(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix the C heap's mmap threshold at `threshold` bytes for this process; False (and
    nothing changed) where the C library has no glibc `mallopt` (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        log.info("no mallopt in the C library (%s): the heap keeps its own policy", name)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))
