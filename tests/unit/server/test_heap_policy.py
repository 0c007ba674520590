"""The server's C heap policy: large freed blocks go back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
import warnings
from pathlib import Path

import pytest

from bench.synthetic_run import SyntheticRun, small_config
from publisher.store import FileStore
from server import app as app_module
from server.app import create_app
from server.heap_policy import MMAP_THRESHOLD_BYTES, return_large_blocks
from server.settings import ServerSettings

with warnings.catch_warnings():  # starlette's notice about its httpx-based client
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

MiB = 1 << 20
LIBC = ctypes.CDLL(ctypes.util.find_library("c"))


#: glibc's `struct mallinfo2`, field by field.
MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2_FIELDS.split()]


def _mapped_bytes() -> int:
    """Bytes of the blocks malloc serves with their own mmap."""
    mallinfo2 = LIBC.mallinfo2
    mallinfo2.restype = MallInfo2
    return int(mallinfo2().hblkhd)


@pytest.mark.skipif(not hasattr(LIBC, "mallinfo2"), reason="not glibc >= 2.33")
def test_a_block_over_the_threshold_is_mapped_after_a_larger_one_was_freed() -> None:
    LIBC.malloc.restype = ctypes.c_void_p
    LIBC.malloc.argtypes = [ctypes.c_size_t]
    LIBC.free.argtypes = [ctypes.c_void_p]
    assert return_large_blocks()
    # glibc's own policy would raise its threshold to 24 MiB here, and serve the next block
    # from an arena, where it stays resident once freed.
    LIBC.free(LIBC.malloc(24 * MiB))
    before = _mapped_bytes()
    size = 4 * MMAP_THRESHOLD_BYTES
    block = LIBC.malloc(size)
    try:
        assert _mapped_bytes() - before >= size
    finally:
        LIBC.free(block)
    assert _mapped_bytes() == before  # unmapped when freed


def test_the_server_sets_the_policy_when_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    SyntheticRun(FileStore(tmp_path / "store"), "m", small_config()).publish("full")
    calls: list[int] = []
    monkeypatch.setattr(app_module, "return_large_blocks", lambda: calls.append(1) or True)
    settings = ServerSettings(store=f"file://{tmp_path / 'store'}", model="m", follow=False)
    with TestClient(create_app(settings)):
        assert calls == [1]
