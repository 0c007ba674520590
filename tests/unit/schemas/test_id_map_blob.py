"""The id-map blob (docs/FORMAT.md section 7): round trips, the pinned layout, one test per
rejection built from hand-made tensors, and mutated bytes that must decode or raise a
FormatError and nothing else."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.errors import FormatError
from schemas.id_map_blob import (
    MAX_KEY_BYTES,
    IdEntries,
    IdMapBlobError,
    decode_id_entries,
    decode_id_map_blob,
    encode_id_entries,
    max_id_map_blob_bytes,
)
from schemas.tensor_blob import TensorBlobError, decode_tensors, encode_tensors

META = {"format": "checknrun-idmap", "version": 1, "hashed": False}


def entries(keys: list[str], counts: list[int] | None = None) -> IdEntries:
    n = len(keys)
    return IdEntries(
        np.array([bool(k) for k in keys], dtype=np.bool_),
        np.array(counts if counts is not None else range(n), dtype=np.int64),
        np.arange(n, dtype=np.float64) * 1.5 + 1.7e9,
        tuple(keys),
    )


def tensors_of(keys: list[str]) -> dict[str, np.ndarray]:
    """The five tensors of a valid blob of `keys` (to break one at a time)."""
    tensors, _ = decode_tensors(encode_id_entries(entries(keys), hashed=False))
    return {name: array.copy() for name, array in tensors.items()}


def blob(tensors: dict[str, np.ndarray], meta: dict[str, Any] | None = None) -> bytes:
    return encode_tensors(tensors, META if meta is None else meta)


def same(a: IdEntries, b: IdEntries) -> bool:
    return (
        a.keys == b.keys
        and np.array_equal(a.assigned, b.assigned)
        and np.array_equal(a.counts, b.counts)
        and np.array_equal(a.last_seen, b.last_seen)
    )


@pytest.mark.parametrize(
    "keys",
    [
        ["", "u1", "", "ünïcode-ключ", "42"],
        [],
        ["x" * MAX_KEY_BYTES, "é" * (MAX_KEY_BYTES // 2)],
        [""] * 7,
    ],
)
def test_round_trip(keys: list[str]) -> None:
    original = entries(keys)
    data = encode_id_entries(original, hashed=False)
    assert same(decode_id_entries(data, n_rows=len(keys), hashed=False), original)
    assert decode_id_map_blob(data, n_rows=len(keys))[1] is False


def test_a_hashed_blob_round_trips_and_says_so() -> None:
    original = entries(["", "", ""], counts=[5, 0, 2])
    data = encode_id_entries(original, hashed=True)
    assert same(decode_id_entries(data, n_rows=3, hashed=True), original)
    decoded, hashed = decode_id_map_blob(data, n_rows=3)
    assert hashed is True and same(decoded, original)


def test_the_layout_is_pinned() -> None:
    data = encode_id_entries(
        IdEntries(
            np.array([False, True]),
            np.array([0, 3], dtype=np.int64),
            np.array([0.0, 1.5], dtype=np.float64),
            ("", "ab"),
        ),
        hashed=False,
    )
    tensors, meta = decode_tensors(data)
    assert meta == META
    assert {k: (v.dtype.str, v.shape) for k, v in tensors.items()} == {
        "assigned": ("|u1", (2,)),
        "counts": ("<i8", (2,)),
        "last_seen": ("<f8", (2,)),
        "key_ends": ("<i8", (2,)),
        "key_bytes": ("|u1", (2,)),
    }
    assert tensors["key_ends"].tolist() == [0, 2] and tensors["key_bytes"].tobytes() == b"ab"
    # The bytes themselves (safetensors' length prefix and header, then the tensors, the 8-byte
    # ones first): a change here is a format change every reader has to follow.
    assert len(data) == 468
    assert hashlib.sha256(data).hexdigest() == GOLDEN_SHA256


GOLDEN_SHA256 = "12608cce74f4377e5651fe53e2cc73897179eaf049c628a4621ab7ae6d43ce8a"


def break_tensor(name: str, value: np.ndarray) -> bytes:
    tensors = tensors_of(["", "u1", "u2"])
    tensors[name] = value
    return blob(tensors)


@pytest.mark.parametrize(
    ("data", "n_rows", "message"),
    [
        (blob(tensors_of(["a"]), {**META, "format": "other"}), 1, "metadata"),
        (blob(tensors_of(["a"]), {**META, "version": 2}), 1, "metadata"),
        (blob(tensors_of(["a"]), {**META, "version": True}), 1, "metadata"),
        (blob(tensors_of(["a"]), {**META, "hashed": 0}), 1, "metadata"),
        (blob(tensors_of(["a"]), {**META, "extra": 1}), 1, "metadata"),
        (blob(tensors_of(["a"]), {}), 1, "metadata"),
        (blob({k: v for k, v in tensors_of(["a"]).items() if k != "counts"}), 1, "tensors are"),
        (blob({**tensors_of(["a"]), "more": np.zeros(1, np.uint8)}), 1, "tensors are"),
        (break_tensor("counts", np.zeros(3, dtype=np.int32)), 3, "'counts' is int32"),
        (break_tensor("last_seen", np.zeros(3, dtype=np.float32)), 3, "'last_seen' is float32"),
        (
            break_tensor("assigned", np.zeros((3, 1), dtype=np.uint8)),
            3,
            "'assigned' is uint8(3, 1)",
        ),
        (break_tensor("counts", np.zeros(4, dtype=np.int64)), 3, "has 4 rows, not 3"),
        (break_tensor("assigned", np.array([0, 2, 1], dtype=np.uint8)), 3, "other than 0 or 1"),
        (break_tensor("counts", np.array([0, -1, 0], dtype=np.int64)), 3, "counts must be >= 0"),
        (break_tensor("last_seen", np.array([0, np.nan, 0])), 3, "last_seen finite"),
        (break_tensor("last_seen", np.array([0, np.inf, 0])), 3, "last_seen finite"),
        (break_tensor("key_ends", np.array([0, 2, 1], dtype=np.int64)), 3, "non-decreasing"),
        (break_tensor("key_ends", np.array([-1, 2, 4], dtype=np.int64)), 3, "non-decreasing"),
        (break_tensor("key_ends", np.array([0, 2, 5], dtype=np.int64)), 3, "do not end"),
        (break_tensor("key_ends", np.array([0, 2, 3], dtype=np.int64)), 3, "do not end"),
        (break_tensor("assigned", np.array([1, 1, 1], dtype=np.uint8)), 3, "needs a key"),
        (break_tensor("assigned", np.array([0, 0, 1], dtype=np.uint8)), 3, "needs a key"),
        (break_tensor("key_bytes", np.frombuffer(b"u1\xff\xfe", np.uint8)), 3, "UTF-8"),
    ],
)
def test_a_broken_blob_is_refused(data: bytes, n_rows: int, message: str) -> None:
    with pytest.raises(IdMapBlobError, match=re.escape(message)):
        decode_id_entries(data, n_rows=n_rows, hashed=False)


def test_a_key_step_over_the_cap_is_refused() -> None:
    long = "k" * (MAX_KEY_BYTES + 1)
    tensors = tensors_of(["a"])
    tensors["key_ends"] = np.array([len(long)], dtype=np.int64)
    tensors["key_bytes"] = np.frombuffer(long.encode(), dtype=np.uint8)
    with pytest.raises(IdMapBlobError, match="steps of <= 256"):
        decode_id_entries(blob(tensors), n_rows=1, hashed=False)


def test_offsets_that_wrap_around_int64_are_refused() -> None:
    tensors = tensors_of(["", "a", ""])
    tensors["key_ends"] = np.array([2**63 - 1, -(2**63), 1], dtype=np.int64)
    with pytest.raises(IdMapBlobError):
        decode_id_entries(blob(tensors), n_rows=3, hashed=False)


def test_the_mode_must_be_the_expected_one() -> None:
    dynamic = encode_id_entries(entries(["", "a"]), hashed=False)
    with pytest.raises(IdMapBlobError, match="dynamic map, expected a hashed one"):
        decode_id_entries(dynamic, n_rows=2, hashed=True)
    hashed = encode_id_entries(entries(["", ""]), hashed=True)
    with pytest.raises(IdMapBlobError, match="hashed map, expected a dynamic one"):
        decode_id_entries(hashed, n_rows=2, hashed=False)


def test_a_hashed_blob_that_assigns_a_key_is_refused() -> None:
    data = blob(tensors_of(["", "a"]), {**META, "hashed": True})
    with pytest.raises(IdMapBlobError, match="hashed id map assigns no keys"):
        decode_id_map_blob(data, n_rows=2)


def test_the_row_count_must_be_the_manifest_entrys() -> None:
    data = encode_id_entries(entries(["", "a"]), hashed=False)
    with pytest.raises(IdMapBlobError, match="has 2 rows, not 3"):
        decode_id_entries(data, n_rows=3, hashed=False)


def test_a_blob_over_the_size_cap_is_refused_before_it_is_parsed() -> None:
    assert max_id_map_blob_bytes(2) == 4096 + 2 * 281
    data = b"\x00" * (max_id_map_blob_bytes(2) + 1)
    with pytest.raises(IdMapBlobError, match="the cap is"):
        decode_id_entries(data, n_rows=2, hashed=False)
    # Within the cap, the same junk is the tensor blob's error.
    with pytest.raises(TensorBlobError):
        decode_id_entries(data[:100], n_rows=2, hashed=False)


@pytest.mark.parametrize("data", [b"", b"\x01" * 7, b"\xff" * 64, b"{}" * 40])
def test_garbage_is_a_format_error(data: bytes) -> None:
    with pytest.raises(FormatError):
        decode_id_entries(data, n_rows=1, hashed=False)


def test_merge_takes_the_newer_entries_of_shared_rows() -> None:
    older, older_ids = entries(["a", "", "c"], counts=[1, 2, 3]), np.array([1, 4, 7])
    newer, newer_ids = entries(["", "d"], counts=[9, 8]), np.array([4, 9])
    ids = np.union1d(older_ids, newer_ids)
    merged = IdEntries.merge(ids, older, older_ids, newer, newer_ids)
    assert merged.keys == ("a", "", "c", "d")
    assert merged.counts.tolist() == [1, 9, 3, 8]
    assert merged.assigned.tolist() == [True, False, True, True]
    assert merged.last_seen.tolist() == [
        older.last_seen[0],
        newer.last_seen[0],
        older.last_seen[2],
        newer.last_seen[1],
    ]


def test_take_copies_the_entries_at_positions() -> None:
    original = entries(["a", "", "c", "d"])
    taken = original.take(np.array([3, 1]))
    assert taken.keys == ("d", "") and taken.counts.tolist() == [3, 1]
    taken.counts[0] = 99
    assert original.counts[3] == 3


VALID = encode_id_entries(entries(["", "u1", "ключ", "", "42"]), hashed=False)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=600),
        st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)).map(
            lambda iv: VALID[: iv[0]] + bytes([iv[1]]) + VALID[iv[0] + 1 :]
        ),
        st.integers(0, len(VALID)).map(lambda n: VALID[:n]),
    )
)
def test_mutated_bytes_decode_or_raise_a_format_error(data: bytes) -> None:
    try:
        decoded, hashed = decode_id_map_blob(data, n_rows=5)
    except FormatError:
        return
    # Whatever decodes is a valid blob: it encodes back to a blob that decodes the same.
    again, again_hashed = decode_id_map_blob(encode_id_entries(decoded, hashed=hashed), n_rows=5)
    assert same(again, decoded) and again_hashed == hashed
