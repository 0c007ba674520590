"""`checknrun train` against MinIO when another trainer takes the model over mid-run: the lease's
compare-and-swap fails on the real S3 server (412 on If-Match), and the trainer ends in one line
and, with --json, the error document (issue 11, item 8)."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest

from publisher.read.catalog import Catalog, VersionRef
from publisher.store import open_store
from publisher.write.version_writer import VersionWriter
from schemas.manifest import Lease
from schemas.store_keys import lease_key
from tests.integration.test_s3_store import s3_environ
from trainer.cli import main


def test_a_lease_lost_mid_run_ends_in_one_line_on_s3(
    services: Any,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in s3_environ(services).items():
        monkeypatch.setenv(name, value)
    commit = VersionWriter.commit_parts

    def commit_then_lose_the_lease(writer: VersionWriter, *args: Any, **kwargs: Any) -> VersionRef:
        ref = commit(writer, *args, **kwargs)
        if ref.version == 1:  # another trainer took the expired lease while this one paused
            other = Lease(model=writer.model, owner="other-host:1", token="t", expires_at=1e12)
            writer.store.put(lease_key(writer.model), other.to_json())
        return ref

    monkeypatch.setattr(VersionWriter, "commit_parts", commit_then_lose_the_lease)
    url = f"s3://{unique_name}/trainer"
    argv = ["train", "--data", "synthetic", "--table-cap", "400", "--embedding-dim", "8"]
    argv += ["--batch-size", "256", "--interval-samples", "2048", "--max-samples", "20480"]
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse invariant checks")
            status = main([*argv, "--store", url, "--json", "--no-progress"])
        out, err = capsys.readouterr()
        assert status == 1
        message = "model 'synthetic': lease lost to another writer"
        assert err == f"checknrun train: {message}\n"
        assert json.loads(out) == {
            "error": {"type": "LeaseHeldError", "message": message, "exit_status": 1}
        }
        with open_store(url) as store:
            head = Catalog(store, "synthetic").latest()
        assert head is not None and head.version == 1  # nothing committed after the loss
    finally:
        with open_store(url) as store:
            for info in list(store.list("")):
                store.delete(info.key)
