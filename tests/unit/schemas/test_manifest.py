"""Manifest, HEAD and announcement validation: every rule in docs/FORMAT.md sections 3 and 6."""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas.announcement import Announcement
from schemas.errors import AnnouncementError, ManifestError
from schemas.manifest import Head, Manifest, ServedLoss, full_fp32_bytes, ratio_to_full_fp32

SHA = "ab" * 32


def manifest_doc(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema_version": 1,
        "model": "m",
        "version": 2,
        "parent": 1,
        "parent_manifest": "m/manifests/000000000001-aa.json",
        "kind": "delta",
        "baseline": 1,
        "applies_to": 1,
        "policy": "consecutive",
        "created_at": "2026-11-29T12:00:00+00:00",
        "position": {"step": 10, "samples_seen": 1000, "reader": {"offset": 1000}},
        "tables": [
            {
                "name": "user",
                "rows": 100,
                "dim": 8,
                "codec": "int4",
                "rows_in_checkpoint": 7,
                "aux_dim": 1,
                "blob": {
                    "key": "m/blobs/000000000002-aa/0000-user.cnrd",
                    "size": 10,
                    "sha256": SHA,
                },
            }
        ],
        "dense": {"key": "m/blobs/000000000002-aa/dense.safetensors", "size": 5, "sha256": SHA},
        "optimizer": None,
        "model_config": {"kind": "dlrm", "tables": {"user": 100}},
        "metrics": {"auc": 0.75},
    }
    doc.update(overrides)
    return doc


def parse(doc: dict[str, Any]) -> Manifest:
    return Manifest.from_json(json.dumps(doc).encode())


def test_valid_manifest_round_trips() -> None:
    m = parse(manifest_doc())
    assert m.version == 2 and m.table("user").rows_in_checkpoint == 7
    assert m.model_config_ == {"kind": "dlrm", "tables": {"user": 100}}
    assert Manifest.from_json(m.to_json()) == m
    assert m.total_bytes == 15


@pytest.mark.parametrize(
    "overrides",
    [
        {"schema_version": 2},
        {"model": "bad name"},
        {"model": "../x"},
        {"version": 0},
        {"parent": 2},
        {"parent": None},
        {"kind": "partial"},
        {"applies_to": None},
        {"applies_to": 2},
        {"applies_to": 0, "baseline": 1},
        {"extra": 1},
        {"version": "2"},
        {"version": True},
        {"metrics": {"auc": "high"}},
        {"created_at": "yesterday"},
        {"created_at": "2026-11-30T09:20:08"},  # no UTC offset: readers subtract it from aware
        {"parent_manifest": "other/manifests/000000000001-aa.json"},
        {"parent_manifest": "m/../etc/passwd"},
    ],
)
def test_manifest_rejections(overrides: dict[str, Any]) -> None:
    with pytest.raises(ManifestError):
        parse(manifest_doc(**overrides))


def test_full_fp32_bytes_counts_tables_and_dense_state() -> None:
    """docs/FORMAT.md 3.1: every row x (dim + aux_dim) x 4, plus the dense blobs' tensors."""
    m = parse(manifest_doc(dense_tensor_bytes=3))
    assert m.table("user").full_fp32_bytes(m.metrics) == 100 * (8 + 1) * 4
    assert m.full_fp32_bytes == 100 * (8 + 1) * 4 + 3  # a delta against the full state
    assert m.written_bytes == 15 + len(m.to_json())
    assert m.ratio_to_full_fp32 == m.full_fp32_bytes / m.written_bytes
    assert Manifest.from_json(m.to_json()) == m


def _with_id_map(doc: dict[str, Any], **table: Any) -> dict[str, Any]:
    idmap = {"key": "m/blobs/000000000002-aa/0000-user.idmap", "size": 4, "sha256": SHA}
    doc["tables"] = [{**doc["tables"][0], "id_map": idmap, **table}]
    return doc


def test_a_dynamic_table_counts_the_rows_its_ids_hold_and_a_restore_every_row() -> None:
    """docs/FORMAT.md 3.1 and 7.1: with `ids_held_<table>`, full fp32 bytes follow the ids."""
    m = parse(_with_id_map(manifest_doc(metrics={"ids_held_user": 9.0}, dense_tensor_bytes=3)))
    assert m.full_fp32_bytes == 10 * (8 + 1) * 4 + 3  # 9 ids and the unknown row
    assert m.restored_fp32_bytes == 100 * (8 + 1) * 4 + 3
    # without the metric, or without an id map, every row counts
    assert parse(_with_id_map(manifest_doc(dense_tensor_bytes=3))).full_fp32_bytes == 3603
    plain = parse(manifest_doc(metrics={"ids_held_user": 9.0}, dense_tensor_bytes=3))
    assert plain.full_fp32_bytes == 3603


FULL = {"kind": "full", "baseline": 2, "applies_to": None}


def test_only_a_full_of_a_table_with_an_id_map_may_leave_rows_out() -> None:
    assert parse(_with_id_map(manifest_doc(**FULL))).table("user").rows_in_checkpoint == 7
    with pytest.raises(ManifestError, match="every row"):
        parse(manifest_doc(**FULL))


def test_manifest_without_tensor_bytes_counts_whole_dense_blob() -> None:
    # Written before the fields existed: still parses; the dense blob counts header and all.
    m = parse(manifest_doc())
    assert m.dense_tensor_bytes is None and m.optimizer_tensor_bytes is None
    assert m.full_fp32_bytes == 100 * (8 + 1) * 4 + 5


@pytest.mark.parametrize(
    "overrides",
    [
        {"dense_tensor_bytes": 6},  # more than the 5-byte dense blob
        {"dense_tensor_bytes": -1},
        {"optimizer_tensor_bytes": 1},  # no optimizer blob
    ],
)
def test_tensor_bytes_rejections(overrides: dict[str, Any]) -> None:
    with pytest.raises(ManifestError, match="tensor_bytes"):
        parse(manifest_doc(**overrides))


def test_ratio_and_full_fp32_helpers() -> None:
    assert full_fp32_bytes([(10, 4, 1), (3, 4, 0)], dense_state_bytes=7) == 200 + 48 + 7
    assert ratio_to_full_fp32(100, 50) == 2.0
    assert ratio_to_full_fp32(100, 0) == 100.0  # nothing written: no division by zero


def table_with(**overrides: Any) -> dict[str, Any]:
    table = dict(manifest_doc()["tables"][0])
    table.update(overrides)
    return table


@pytest.mark.parametrize(
    "table",
    [
        table_with(codec="int5"),
        table_with(rows_in_checkpoint=101),
        table_with(dim=0),
        table_with(blob={"key": "m/x", "size": 1, "sha256": "XYZ"}),
        table_with(blob={"key": "/etc/passwd", "size": 1, "sha256": SHA}),
        table_with(blob={"key": "m/a\\b", "size": 1, "sha256": SHA}),
        table_with(blob={"key": "m/x", "size": -1, "sha256": SHA}),
    ],
)
def test_table_rejections(table: dict[str, Any]) -> None:
    with pytest.raises(ManifestError):
        parse(manifest_doc(tables=[table]))


@pytest.mark.parametrize(
    "overrides",
    [
        # gc deletes a dropped version's blobs: these would delete the commit point or the lease.
        {"tables": [table_with(blob={"key": "m/HEAD", "size": 1, "sha256": SHA})]},
        {"dense": {"key": "m/LEASE", "size": 1, "sha256": SHA}},
        {"optimizer": {"key": "m/manifests/000000000001-aa.json", "size": 1, "sha256": SHA}},
        {"dense": {"key": "m/blobs/", "size": 1, "sha256": SHA}},
        {"parent_manifest": "m/HEAD"},
        {"parent_manifest": "m/blobs/000000000001-aa/x.json"},
    ],
    ids=[
        "table-HEAD",
        "dense-LEASE",
        "optimizer-manifest",
        "blobs-prefix-itself",
        "parent-HEAD",
        "parent-blob",
    ],
)
def test_keys_outside_their_prefix_rejected(overrides: dict[str, Any]) -> None:
    """A blob key lies under MODEL/blobs/, a parent manifest under MODEL/manifests/ (issue 11.3)."""
    # `m/blobs/` (an empty last segment) already fails the one key rule (schemas/store_keys.py).
    with pytest.raises(ManifestError, match=r"not under|not a manifest key|not a safe key"):
        parse(manifest_doc(**overrides))


def test_head_must_name_a_manifest_key() -> None:
    for key in ("m/LEASE", "m/blobs/000000000003-aa/x.json", "m/HEAD"):
        raw = json.dumps({"schema_version": 1, "model": "m", "version": 3, "manifest": key})
        with pytest.raises(ManifestError, match="not a manifest key"):
            Head.from_json(raw.encode())


def test_duplicate_tables_rejected() -> None:
    t = manifest_doc()["tables"][0]
    with pytest.raises(ManifestError, match="duplicate"):
        parse(manifest_doc(tables=[t, t]))


def test_full_rules() -> None:
    full = manifest_doc(
        kind="full",
        version=1,
        parent=None,
        parent_manifest=None,
        baseline=1,
        applies_to=None,
        tables=[table_with(rows_in_checkpoint=100)],
    )
    assert parse(full).kind == "full"
    with pytest.raises(ManifestError, match="every row"):
        parse({**full, "tables": [table_with(rows_in_checkpoint=5)]})
    with pytest.raises(ManifestError):
        parse({**full, "baseline": 1, "version": 3})  # a full is its own baseline
    with pytest.raises(ManifestError):
        parse({**full, "applies_to": 1, "version": 2, "baseline": 2})


def test_manifest_size_cap_and_garbage() -> None:
    with pytest.raises(ManifestError):
        Manifest.from_json(b"{" * 10)
    with pytest.raises(ManifestError):
        Manifest.from_json(b"[]")
    with pytest.raises(ManifestError, match="cap"):
        Manifest.from_json(b" " * (16 * 1024 * 1024 + 1))


def test_head_rules() -> None:
    head = Head(model="m", version=3, manifest="m/manifests/000000000003-aa.json")
    assert Head.from_json(head.to_json()) == head
    with pytest.raises(ManifestError):
        Head.from_json(b'{"schema_version":1,"model":"m","version":3,"manifest":"n/x.json"}')


def ann_doc(**overrides: Any) -> bytes:
    doc: dict[str, Any] = {
        "schema_version": 1,
        "model": "m",
        "version": 2,
        "parent": 1,
        "kind": "delta",
        "manifest_key": "m/manifests/000000000002-aa.json",
        "created_at": "2026-11-29T12:00:00Z",
        "total_bytes": 123,
    }
    doc.update(overrides)
    return json.dumps(doc).encode()


def test_announcement_round_trip() -> None:
    a = Announcement.from_json(ann_doc())
    assert Announcement.from_json(a.to_json()) == a
    m = parse(manifest_doc())
    b = Announcement.of(m, "m/manifests/000000000002-aa.json")
    assert b.total_bytes == 15 and b.kind == "delta" and len(b.to_json()) < 4096


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"{}",
        ann_doc(schema_version=9),
        ann_doc(manifest_key="m/blobs/x.json"),
        ann_doc(manifest_key="s3://elsewhere/m/manifests/x.json"),
        ann_doc(manifest_key="m/manifests/../../etc/passwd.json"),
        ann_doc(parent=5),
        ann_doc(total_bytes=-1),
        ann_doc(surprise=True),
        ann_doc(model="x" * 200),
        ann_doc(created_at="2026-11-30T09:20:08"),  # no UTC offset
        b"{" + b" " * 5000 + b"}",
    ],
)
def test_announcement_rejections(raw: bytes) -> None:
    with pytest.raises(AnnouncementError):
        Announcement.from_json(raw)


SERVED = {
    "samples": 16384,
    "auc_fp32": 0.8,
    "auc_served": 0.79,
    "logloss_fp32": 0.5,
    "logloss_served": 0.51,
    "auc_rel_loss": (0.8 - 0.79) / 0.8,
    "logloss_rel_increase": (0.51 - 0.5) / 0.5,
}


def test_served_loss_round_trips_and_old_manifests_read_without_it() -> None:
    m = parse(manifest_doc(served_loss=SERVED))
    assert m.served_loss is not None and m.served_loss.samples == 16384
    assert m.served_loss == ServedLoss.of(
        16384, auc_fp32=0.8, auc_served=0.79, logloss_fp32=0.5, logloss_served=0.51
    )
    assert Manifest.from_json(m.to_json()) == m
    old = manifest_doc()
    assert "served_loss" not in old  # a manifest written before the field existed
    assert parse(old).served_loss is None


@pytest.mark.parametrize(
    "change",
    [
        {"auc_rel_loss": 0.0},  # disagrees with the absolute figures
        {"logloss_rel_increase": -0.02},
        {"samples": 0},
        {"auc_served": 1.5},
        {"logloss_fp32": -0.1},
        {"extra": 1},
        {"positives": 16385},  # more than the samples
        {"positives": -1},
        {"auc_loss_low": -0.01},  # without its high end
        {"auc_loss_low": 0.011, "auc_loss_high": 0.02},  # not holding the loss (0.01)
        {"auc_loss_low": -0.01, "auc_loss_high": float("inf")},
    ],
)
def test_served_loss_rejections(change: dict[str, Any]) -> None:
    with pytest.raises(ManifestError):
        parse(manifest_doc(served_loss={**SERVED, **change}))


def test_served_loss_says_how_many_positives_and_how_sure_it_is() -> None:
    loss = ServedLoss.of(
        16384,
        auc_fp32=0.8,
        auc_served=0.79,
        logloss_fp32=0.5,
        logloss_served=0.51,
        positives=80,
        auc_loss=(-0.002, 0.022),
    )
    m = parse(manifest_doc(served_loss=json.loads(loss.model_dump_json())))
    assert m.served_loss == loss and Manifest.from_json(m.to_json()) == m
    assert loss.auc_rel_loss_low == pytest.approx(-0.002 / 0.8)  # not significant
    assert (
        ServedLoss.of(
            10, auc_fp32=0.8, auc_served=0.79, logloss_fp32=0.5, logloss_served=0.51
        ).auc_rel_loss_low
        is None
    )  # a record written before the interval existed


def test_served_loss_refuses_non_finite_figures() -> None:
    raw = json.dumps(manifest_doc(served_loss=SERVED)).replace(
        json.dumps(SERVED["auc_rel_loss"]), "1e999"
    )
    with pytest.raises(ManifestError):
        Manifest.from_json(raw.encode())
