"""NewestRows: blobs added newest first give each row from the newest blob that holds it,
decoded once, bit for bit as writing every blob whole, oldest first."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from publisher.codecs import QuantizedRows, decode_rows
from publisher.read import blob_rows
from publisher.read.blob_rows import NewestRows, write_blob
from schemas.codec_names import CODECS
from schemas.delta_blob import DeltaBlob
from tests.support import delta_blob_of

ROWS, DIM, AUX = 300, 6, 2


def blob_of(ids: np.ndarray, codec: str, seed: int = 0) -> DeltaBlob:
    """A blob of rows `ids` of this file's table shape, as the store returns it."""
    return delta_blob_of(ids, codec, table_rows=ROWS, dim=DIM, aux_dim=AUX, seed=seed)


def table() -> tuple[np.ndarray, np.ndarray]:
    """Weights and aux filled with a marker no blob here decodes to."""
    return (
        np.full((ROWS, DIM), -99.0, dtype=np.float32),
        np.full((ROWS, AUX), -99.0, dtype=np.float32),
    )


def oldest_first(blobs: list[DeltaBlob]) -> tuple[np.ndarray, np.ndarray]:
    weights, aux = table()
    for blob in blobs:
        write_blob(blob, weights, aux)
    return weights, aux


def newest_first(blobs: list[DeltaBlob]) -> tuple[np.ndarray, np.ndarray]:
    weights, aux = table()
    rows = NewestRows(weights, aux)
    for blob in reversed(blobs):
        rows.add(blob)
    rows.decode()
    return weights, aux


def assert_same_bits(got: tuple[np.ndarray, np.ndarray], expected: tuple[np.ndarray, ...]) -> None:
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def random_chain(rng: np.random.Generator, codecs: list[str], full_first: bool) -> list[DeltaBlob]:
    """A blob per codec: a full table first if asked, then random rows (none, some or all)."""
    blobs = []
    for i, codec in enumerate(codecs):
        fraction = 1.0 if i == 0 and full_first else rng.choice([0.0, 0.05, 0.4, 0.9, 1.0])
        ids = np.flatnonzero(rng.random(ROWS) < fraction)
        blobs.append(blob_of(ids, codec, seed=i))
    return blobs


@pytest.mark.parametrize("codec", CODECS)
def test_newest_first_is_bitwise_oldest_first(codec: str) -> None:
    rng = np.random.default_rng(CODECS.index(codec))
    for _ in range(4):
        blobs = random_chain(rng, [codec] * 6, full_first=True)
        assert_same_bits(newest_first(blobs), oldest_first(blobs))


def test_a_chain_of_mixed_codecs_is_bitwise_oldest_first() -> None:
    rng = np.random.default_rng(7)
    for _ in range(10):
        codecs = list(rng.choice(CODECS, size=5))
        blobs = random_chain(rng, codecs, full_first=True)
        assert_same_bits(newest_first(blobs), oldest_first(blobs))


def test_rows_no_blob_holds_are_left_alone() -> None:
    blobs = [blob_of(np.array([3, 9]), "int4"), blob_of(np.array([9, 200]), "fp16", seed=1)]
    weights, aux = newest_first(blobs)
    assert_same_bits((weights, aux), oldest_first(blobs))
    untouched = np.setdiff1d(np.arange(ROWS), [3, 9, 200])
    assert (weights[untouched] == -99).all() and (aux[untouched] == -99).all()


class CountingDecode:
    """Stands in for the codec's decode_rows and counts the rows it decodes."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, q: QuantizedRows, out: Any = None) -> np.ndarray:
        self.rows.append(q.n_rows)
        return decode_rows(q, out=out)


def test_each_row_is_decoded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingDecode()
    monkeypatch.setattr(blob_rows, "decode_rows", counting)
    rng = np.random.default_rng(3)
    blobs = [blob_of(np.arange(ROWS), "int4")]
    blobs += [blob_of(np.flatnonzero(rng.random(ROWS) < 0.5), "int4", seed=i) for i in range(5)]
    weights, aux = table()
    rows = NewestRows(weights, aux)
    taken = [rows.add(blob) for blob in reversed(blobs)]
    assert counting.rows == []  # nothing is decoded before `decode`
    rows.decode()
    assert sum(taken) == ROWS and counting.rows == [ROWS]  # every row once, in one call
    assert taken[0] == blobs[-1].n_rows and taken[-1] < ROWS


def test_a_codec_holding_some_rows_decodes_them_in_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    blobs = [blob_of(np.arange(ROWS), "int8"), blob_of(np.arange(0, ROWS, 3), "int4", seed=1)]
    expected = oldest_first(blobs)
    counting = CountingDecode()
    monkeypatch.setattr(blob_rows, "decode_rows", counting)
    monkeypatch.setattr(blob_rows, "PARTIAL_CHUNK_ELEMENTS", 16 * DIM)  # 16 rows a chunk
    assert_same_bits(newest_first(blobs), expected)
    # 100 int4 rows, then the 200 int8 rows they left, each codec 16 rows at a time.
    assert counting.rows == [16] * 6 + [4] + [16] * 12 + [8]


def test_a_full_newest_blob_decodes_in_place_and_older_ones_give_nothing() -> None:
    blobs = [blob_of(np.arange(ROWS), "int4"), blob_of(np.arange(ROWS), "int2", seed=1)]
    weights, aux = table()
    rows = NewestRows(weights, aux)
    assert rows.add(blobs[1]) == ROWS
    assert rows.add(blobs[0]) == 0
    rows.decode()
    assert_same_bits((weights, aux), oldest_first(blobs))


def test_a_blob_of_another_table_shape_is_refused() -> None:
    weights, aux = table()
    rows = NewestRows(weights, aux[:, :1])
    with pytest.raises(ValueError, match="the table is"):
        rows.add(blob_of(np.arange(ROWS), "int4"))


def test_a_table_not_c_contiguous_is_refused() -> None:
    weights, aux = table()
    with pytest.raises(ValueError, match="C-contiguous"):
        NewestRows(np.asfortranarray(weights), aux)
