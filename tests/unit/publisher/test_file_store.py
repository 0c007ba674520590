"""The embedded file:// store: what only it does (temporary files, URLs).

What every store must do (bytes by key, ranges, listing, key safety, conditional writes with one
winner, verified reads, the commit protocol) runs on it from
tests/contracts/test_store_contract.py (its `file` parameter); links, FIFOs and other planted
files are tests/unit/publisher/test_file_store_links.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from publisher.store import FileStore, StoreError, open_store


def test_an_overwrite_leaves_no_temporary_files(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("k", b"1" * 1000)
    store.put("k", b"2" * 10)
    assert store.get("k") == b"2" * 10
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []


def test_open_store_urls(tmp_path: Path) -> None:
    assert isinstance(open_store(f"file://{tmp_path}"), FileStore)
    assert isinstance(open_store(str(tmp_path / "plain")), FileStore)
    with pytest.raises(StoreError, match="unsupported"):
        open_store("ftp://x/y")
