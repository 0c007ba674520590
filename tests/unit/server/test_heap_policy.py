"""The server's C heap policy: large freed blocks go back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from bench.synthetic_run import SyntheticRun, small_config
from publisher.store import FileStore
from server import app as app_module
from server.app import create_app
from server.heap_policy import MMAP_THRESHOLD_BYTES
from server.settings import ServerSettings

with warnings.catch_warnings():  # starlette's notice about its httpx-based client
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

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


def test_the_server_sets_the_policy_when_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    SyntheticRun(FileStore(tmp_path / "store"), "m", small_config()).publish("full")
    calls: list[int] = []
    monkeypatch.setattr(app_module, "return_large_blocks", lambda: calls.append(1) or True)
    settings = ServerSettings(store=f"file://{tmp_path / 'store'}", model="m", follow=False)
    with TestClient(create_app(settings)):
        assert calls == [1]
