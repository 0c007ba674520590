"""What every stream yields (`Batch`) and how a stream resumes (its `reader` position).

A stream is a deterministic function of a sample offset: batch boundaries depend only on the
start offset and the batch size, never on wall-clock or RNG state carried between batches. The
trainer checkpoints at batch boundaries and stores `reader_state(offset)` in the manifest, so a
resumed run sees exactly the batches an uninterrupted run would have seen after that point:
no sample trained twice, none skipped.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from publisher.dlrm import SparseBatch, SparseFeature
from schemas.errors import BadDataError


class DataError(BadDataError, ValueError):
    """Input data that cannot become an interaction stream; the message names the file/column."""


@dataclass(frozen=True)
class Batch:
    """One training batch: dense features, one id bag per sparse feature, binary labels."""

    dense: torch.Tensor  # float32 (B, n_dense)
    sparse: dict[str, SparseBatch]
    labels: torch.Tensor  # float32 (B,), 0 or 1
    #: stream offset of the first sample; the batch covers [offset, offset + size).
    offset: int

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    @property
    def end(self) -> int:
        """Offset right after this batch: the reader position once it is trained on."""
        return self.offset + self.size


@dataclass(frozen=True)
class IdColumn:
    """Ids of one sparse feature for every sample: flat values plus row splits for bags."""

    values: np.ndarray  # int64 (nnz,)
    #: int64 (n + 1,): sample i holds values[splits[i]:splits[i+1]]; None means one id each.
    splits: np.ndarray | None = None
    #: the raw value of each id (id i is vocabulary[i]; null for a missing value), when known:
    #: what `checknrun replay` sends as the event's raw id.
    vocabulary: pa.Array | None = None

    def raw(self, start: int, stop: int) -> list[Any]:
        """The raw ids of samples [start, stop): one value (None: missing) per sample, or a
        list of values per sample for a bag; the encoded ids when there is no vocabulary."""
        lo, hi = (start, stop) if self.splits is None else (self.splits[start], self.splits[stop])
        ids = self.values[lo:hi]
        flat: list[Any] = (
            ids.tolist() if self.vocabulary is None else self.vocabulary.take(ids).to_pylist()
        )
        if self.splits is None:
            return flat
        bounds = (self.splits[start : stop + 1] - lo).tolist()
        return [flat[a:b] for a, b in itertools.pairwise(bounds)]

    def take(self, start: int, stop: int) -> SparseBatch:
        """The ids of samples [start, stop) as an EmbeddingBag input (views, no copy)."""
        if self.splits is None:
            values = self.values[start:stop]
            return SparseBatch(torch.from_numpy(values), torch.arange(stop - start))
        lo, hi = int(self.splits[start]), int(self.splits[stop])
        offsets = self.splits[start:stop] - lo
        return SparseBatch(torch.from_numpy(self.values[lo:hi]), torch.from_numpy(offsets))


class InteractionStream(ABC):
    """A replayable stream of labelled interactions, resumable from a sample offset."""

    #: short name stored in the reader position ("movielens", "synthetic", "file").
    source: str
    #: called (on the consuming thread, between batches) while a live stream waits for events,
    #: so the training loop can publish what it trained when the interval passes with the
    #: stream quiet; a file stream never waits.
    on_idle: Callable[[], None] | None = None

    @property
    @abstractmethod
    def features(self) -> tuple[SparseFeature, ...]:
        """Sparse features in model order, with table sizes."""

    @property
    @abstractmethod
    def dense_names(self) -> tuple[str, ...]:
        """Names of the dense feature columns, in order."""

    @property
    @abstractmethod
    def num_samples(self) -> int | None:
        """Samples in the stream, or None when it never ends."""

    @property
    @abstractmethod
    def fingerprint(self) -> str:
        """Identifies the data (and its preprocessing), so a resume on other data is refused."""

    @abstractmethod
    def batches(self, batch_size: int, start: int = 0, stop: int | None = None) -> Iterator[Batch]:
        """Batches of `batch_size` samples (the last may be smaller) covering [start, stop)."""

    def metrics(self) -> dict[str, float]:
        """What the stream counts for every manifest's `metrics` (a live stream: bad events,
        consumer lag, id space); none for a replayed file."""
        return {}

    def reader_state(self, offset: int) -> dict[str, int | str | dict[str, int]]:
        """The manifest's `position.reader` for a stream consumed up to `offset`."""
        return {"source": self.source, "offset": offset, "fingerprint": self.fingerprint}

    def resume_offset(self, reader: Mapping[str, int | str | dict[str, int]]) -> int:
        """The offset a checkpoint's reader position says to continue from; DataError if the
        position belongs to another stream."""
        if reader.get("source") != self.source or reader.get("fingerprint") != self.fingerprint:
            raise DataError(
                f"the checkpoint was trained on source={reader.get('source')!r} "
                f"fingerprint={reader.get('fingerprint')!r}, but this stream is "
                f"source={self.source!r} fingerprint={self.fingerprint!r}: resume on the same "
                "data with the same options"
            )
        offset = reader.get("offset")
        if not isinstance(offset, int) or offset < 0:
            raise DataError(f"checkpoint reader offset {offset!r} is not an int >= 0")
        total = self.num_samples
        if total is not None and offset > total:
            raise DataError(f"checkpoint reader offset {offset} is past the stream's {total}")
        return offset


class ColumnarStream(InteractionStream):
    """A stream over columns held in memory (already in replay order): batches are slices."""

    def __init__(
        self,
        *,
        source: str,
        features: tuple[SparseFeature, ...],
        columns: Mapping[str, IdColumn],
        dense_names: tuple[str, ...],
        dense: np.ndarray,
        labels: np.ndarray,
        fingerprint_parts: tuple[object, ...],
        timestamps: np.ndarray | None = None,
        numbers: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """`timestamps`: event time of each sample (unix seconds), when the data has one;
        `numbers`: the data's numeric columns as it has them (float64, NaN: missing), which
        `checknrun replay` sends as the events' dense fields."""
        n = int(labels.shape[0])
        if dense.shape != (n, len(dense_names)):
            raise DataError(f"dense features are {dense.shape}, expected {(n, len(dense_names))}")
        missing = [f.name for f in features if f.name not in columns]
        if missing:
            raise DataError(f"no id column for sparse features {missing}")
        self.source = source
        self._features = features
        self._columns = dict(columns)
        self._dense_names = dense_names
        self._dense = np.ascontiguousarray(dense, dtype=np.float32)
        self._labels = np.ascontiguousarray(labels, dtype=np.float32)
        self._fingerprint = fingerprint_of(*fingerprint_parts, n, features, dense_names)
        self.timestamps = timestamps
        self.numbers = dict(numbers or {})

    @property
    def features(self) -> tuple[SparseFeature, ...]:
        return self._features

    @property
    def dense_names(self) -> tuple[str, ...]:
        return self._dense_names

    @property
    def num_samples(self) -> int:
        return int(self._labels.shape[0])

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def labels(self) -> np.ndarray:
        """Every label, in replay order (read-only use)."""
        return self._labels

    def column(self, feature: str) -> IdColumn:
        """The id column of one sparse feature."""
        return self._columns[feature]

    @property
    def dense(self) -> np.ndarray:
        """The model's dense inputs, (samples, dense_names) float32 (read-only use)."""
        return self._dense

    def replaced(
        self,
        *,
        labels: np.ndarray | None = None,
        columns: Mapping[str, IdColumn] | None = None,
        dense: np.ndarray | None = None,
        numbers: Mapping[str, np.ndarray] | None = None,
    ) -> ColumnarStream:
        """A copy with the arrays given in place of its own (`columns`, `numbers`: those
        features' only), sharing every other one; same features, names and fingerprint."""
        out = copy.copy(self)
        if labels is not None:
            out._labels = np.ascontiguousarray(labels, dtype=np.float32)
        if dense is not None:
            out._dense = np.ascontiguousarray(dense, dtype=np.float32)
        out._columns = {**self._columns, **dict(columns or {})}
        out.numbers = {**self.numbers, **dict(numbers or {})}
        return out

    def batches(self, batch_size: int, start: int = 0, stop: int | None = None) -> Iterator[Batch]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        end = self.num_samples if stop is None else min(stop, self.num_samples)
        for lo in range(start, end, batch_size):
            hi = min(lo + batch_size, end)
            yield Batch(
                dense=torch.from_numpy(self._dense[lo:hi]),
                sparse={f.name: self._columns[f.name].take(lo, hi) for f in self._features},
                labels=torch.from_numpy(self._labels[lo:hi]),
                offset=lo,
            )


def fingerprint_of(*parts: object) -> str:
    """A short stable hash of reprs (enough to tell data sets and options apart)."""
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()
    return digest[:16]


def encode_categories(values: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, int]:
    """Map arbitrary values to ids 0..k-1 in order of first appearance; returns (ids, k).

    First-appearance order (not sorted order) keeps ids stable when a log grows at its end.
    Missing values (null) get an id of their own.
    """
    column, rows = id_column(values)
    return column.values, rows


def id_column(values: pa.Array | pa.ChunkedArray) -> tuple[IdColumn, int]:
    """`encode_categories` as a column that keeps its vocabulary; returns (column, k)."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    encoded = pc.dictionary_encode(values, null_encoding="encode")
    ids = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    return IdColumn(ids, vocabulary=encoded.dictionary), max(len(encoded.dictionary), 1)


def bag_column(text: pa.Array, separator: str) -> tuple[IdColumn, int]:
    """A text column of `separator`-separated tokens per sample as a bag column; returns the
    column and the number of distinct tokens. Empty text is an empty bag (EmbeddingBag sums
    it to zeros)."""
    lists = pc.split_pattern(text, separator)
    lengths = pc.list_value_length(lists).to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(lists)
    keep = pc.not_equal(flat, "")  # "".split gives [""]: no token
    owner = np.repeat(np.arange(len(lengths)), lengths)[keep.to_numpy(zero_copy_only=False)]
    splits = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner, minlength=len(lengths)), out=splits[1:])
    tokens, rows = id_column(pc.filter(flat, keep))
    return IdColumn(tokens.values, splits, tokens.vocabulary), rows


def prior_count_log(ids: np.ndarray) -> np.ndarray:
    """log1p of how many earlier samples had the same id (a causal popularity feature)."""
    n = len(ids)
    order = np.argsort(ids, kind="stable")  # stable: equal ids stay in time order
    sorted_ids = ids[order]
    starts = np.r_[True, sorted_ids[1:] != sorted_ids[:-1]]
    group_start = np.maximum.accumulate(np.where(starts, np.arange(n), 0))
    counts = np.empty(n, dtype=np.float64)
    counts[order] = np.arange(n) - group_start
    return np.log1p(counts)
