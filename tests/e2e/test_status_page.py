"""The release gate's status page in a real headless browser (Debian's Chromium): a `checknrun
serve` process on a store a trainer with `--gate` published to, and a person's rollback; the
page Chromium loads lists every version with its status and reason, draws each judged version's
AUC, and renders to a PNG."""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

import pytest

from bench.browser import chromium_path, dump_dom, screenshot
from bench.child_server import ChildServer
from publisher.cli import main as store_main
from trainer.cli import main as train_main

pytestmark = pytest.mark.slow

TRAIN = [
    "train",
    "--data",
    "synthetic",
    "--table-cap",
    "2000",
    "--embedding-dim",
    "8",
    "--batch-size",
    "256",
    "--interval-samples",
    "4096",
    "--served-loss-samples",
    "4096",
    "--max-samples",
    "40960",
    "--codec",
    "int8",
    "--gate",
    "--no-progress",
]


@pytest.fixture(scope="module")
def chromium() -> str:
    path = chromium_path()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs Chromium for the status page's test (scripts/setup.sh)")
        pytest.skip("no Chromium here (apt install chromium)")
    return path


def test_the_status_page_in_a_headless_browser(chromium: str, tmp_path: Path) -> None:
    store = f"file://{tmp_path / 'store'}"
    assert train_main([*TRAIN, "--store", store, "--model", "synthetic"]) == 0
    common = ["--store", store, "--model", "synthetic"]
    # A person's rollback: the version RELEASED named is now "rolled_back".
    assert store_main(["rollback", "2", *common, "--reason", "checked by <b>hand</b>"]) == 0
    with ChildServer(store, "synthetic", tmp_path / "server.log") as server:
        server.wait_ready()
        doc = server.client.get("/status.json").json()
        versions = [v["version"] for v in doc["versions"]]
        assert versions == list(range(1, 11)) and doc["released"] == 2
        statuses = {v["version"]: v["release"]["status"] for v in doc["versions"]}
        assert statuses[2] == "released" and statuses[10] == "pending"
        assert "rolled_back" in statuses.values()
        judged = [v for v in doc["versions"] if v["evaluation"] is not None]
        assert len(judged) == 9

        dom = dump_dom(f"{server.url}/status")
        rows = re.findall(r"<tr data-version=\"(\d+)\" data-status=\"([a-z_-]+)\">", dom)
        assert [int(v) for v, _ in rows] == list(range(10, 0, -1))  # newest first
        assert dict((int(v), s) for v, s in rows) == statuses
        assert len(re.findall(r'<circle class="point"', dom)) == len(judged)
        assert "checked by &lt;b&gt;hand&lt;/b&gt;" in dom  # the store's words are escaped
        assert "<b>hand</b>" not in dom
        assert re.search(r"serving <b>v2</b>", dom), dom[:2000]

        png = screenshot(f"{server.url}/status", tmp_path / "status.png", 1100, 1400)
        header = png.read_bytes()[:24]
        assert header[:8] == b"\x89PNG\r\n\x1a\n"
        assert struct.unpack(">II", header[16:24]) == (1100, 1400)
