"""A Criteo-like synthetic stream: 26 Zipf-distributed sparse ids, 13 dense features, drifting
popularity and labels from a hidden teacher, deterministic by seed and by sample offset.

No Criteo sample ships in any package, so the large-table workload is generated. What makes it
Criteo-like is what matters to checkpointing: table sizes spanning 3 to millions of rows, a few
hot ids and a long tail (so an interval touches a small, shifting fraction of each big table),
and labels that depend on the ids (so AUC measures whether the model learned the tables).

Generation works in fixed chunks of `chunk` samples; chunk c draws from a generator seeded with
(seed, c) only, so sample i is the same whatever batch size or resume offset reads it.

- ids: rank r ~ Zipf(s) over the table's n rows (inverse CDF), then
  id = (a * ((r + shift(i)) mod n) + b) mod n, an affine bijection with gcd(a, n) = 1 that
  scatters hot ids over the table. shift(i) = floor(drift * n * i / 1e6): every million samples
  the popularity ranking rotates by `drift` of the table, so new ids keep becoming hot.
- labels: Bernoulli(sigmoid(teacher)), where the teacher adds a per-id effect of every feature
  (a hash of the id: no table is stored), dot products of 4-d hashed id vectors for a few
  feature pairs, and a linear + tanh term on the dense features.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from publisher.dlrm import SparseBatch, SparseFeature
from trainer.streams.base import Batch, DataError, InteractionStream, fingerprint_of

#: cardinalities of the 26 categorical features of Criteo's Kaggle display-ads data set.
# fmt: off
CRITEO_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
    14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
# fmt: on
N_DENSE = 13
_TEACHER_DIM = 4
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def criteo_like_cardinalities(cap: int) -> tuple[int, ...]:
    """Criteo's 26 cardinalities, each capped at `cap` rows.

    cap=730_000 gives ~4.22M rows: ~1.08 GB of fp32 embeddings at dim 64.
    """
    if cap < 1:
        raise DataError(f"table cap must be >= 1, got {cap}")
    return tuple(min(c, cap) for c in CRITEO_CARDINALITIES)


@dataclass(frozen=True)
class SyntheticConfig:
    """Everything the stream is a function of."""

    cardinalities: tuple[int, ...] = criteo_like_cardinalities(730_000)
    seed: int = 0
    zipf_exponent: float = 1.05
    #: fraction of each table's popularity ranking that rotates per million samples.
    drift: float = 0.02
    #: samples in the stream; None for an endless stream.
    num_samples: int | None = None
    chunk: int = 8192
    #: shifts the teacher's logits; -1.7 gives a positive rate near 30%.
    label_bias: float = -1.7

    def validate(self) -> None:
        if not self.cardinalities or any(c < 1 or c > 2**31 for c in self.cardinalities):
            raise DataError(f"cardinalities must be 1 .. 2**31, got {self.cardinalities}")
        if self.zipf_exponent <= 0:
            raise DataError(f"zipf_exponent must be > 0, got {self.zipf_exponent}")
        if self.drift < 0:
            raise DataError(f"drift must be >= 0, got {self.drift}")
        if self.chunk < 1:
            raise DataError(f"chunk must be >= 1, got {self.chunk}")
        if self.num_samples is not None and self.num_samples < 1:
            raise DataError(f"num_samples must be >= 1, got {self.num_samples}")


@dataclass(frozen=True)
class _Chunk:
    ids: np.ndarray  # int64 (chunk, tables)
    dense: np.ndarray  # float32 (chunk, 13)
    labels: np.ndarray  # float32 (chunk,)


class SyntheticStream(InteractionStream):
    """The synthetic stream described in the module docstring."""

    source = "synthetic"

    def __init__(self, config: SyntheticConfig) -> None:
        config.validate()
        self.config = config
        n_tables = len(config.cardinalities)
        self._features = tuple(
            SparseFeature(f"c{t + 1}", rows) for t, rows in enumerate(config.cardinalities)
        )
        self._cdfs = [_zipf_cdf(n, config.zipf_exponent) for n in config.cardinalities]
        self._affine = [_scatter(n, config.seed, t) for t, n in enumerate(config.cardinalities)]
        teacher = np.random.default_rng([config.seed, 0x7EAC4E2])
        # Large tables matter most (they are the user/item-like features of CTR data).
        size_weight = np.log10(np.asarray(config.cardinalities, dtype=np.float64) + 1.0)
        self._id_weight = 0.25 * size_weight * teacher.uniform(0.5, 1.5, n_tables)
        n_pairs = min(6, n_tables * (n_tables - 1) // 2)
        biggest = np.argsort(-np.asarray(config.cardinalities), kind="stable")[: min(6, n_tables)]
        pairs = [(int(a), int(b)) for a in biggest for b in biggest if a < b][:n_pairs]
        self._pairs = pairs
        self._dense_weight = teacher.normal(0.0, 0.3, N_DENSE)
        self._salts = teacher.integers(1, 2**63, size=(n_tables, 1 + _TEACHER_DIM)).astype(
            np.uint64
        )
        self._fingerprint = fingerprint_of("synthetic", config)
        self._cache: tuple[int, _Chunk] | None = None

    @property
    def features(self) -> tuple[SparseFeature, ...]:
        return self._features

    @property
    def dense_names(self) -> tuple[str, ...]:
        return tuple(f"i{j + 1}" for j in range(N_DENSE))

    @property
    def num_samples(self) -> int | None:
        return self.config.num_samples

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def batches(self, batch_size: int, start: int = 0, stop: int | None = None) -> Iterator[Batch]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        ends = [s for s in (stop, self.config.num_samples) if s is not None]
        end = min(ends) if ends else None
        lo = start
        while end is None or lo < end:
            hi = lo + batch_size if end is None else min(lo + batch_size, end)
            yield self._batch(lo, hi)
            lo = hi

    def _batch(self, lo: int, hi: int) -> Batch:
        size = self.config.chunk
        parts = []
        for c in range(lo // size, (hi - 1) // size + 1):
            chunk = self._chunk(c)
            a, b = max(lo - c * size, 0), min(hi - c * size, size)
            parts.append((chunk.ids[a:b], chunk.dense[a:b], chunk.labels[a:b]))
        ids = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        dense = np.concatenate([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        labels = np.concatenate([p[2] for p in parts]) if len(parts) > 1 else parts[0][2]
        offsets = torch.arange(hi - lo)
        # Column t of a C-ordered (B, tables) array is strided: copy each to contiguous ids.
        ids_t = np.ascontiguousarray(ids.T)
        sparse = {
            f.name: SparseBatch(torch.from_numpy(ids_t[t]), offsets)
            for t, f in enumerate(self._features)
        }
        return Batch(
            dense=torch.from_numpy(np.ascontiguousarray(dense)),
            sparse=sparse,
            labels=torch.from_numpy(np.ascontiguousarray(labels)),
            offset=lo,
        )

    def _chunk(self, c: int) -> _Chunk:
        if self._cache is not None and self._cache[0] == c:
            return self._cache[1]
        chunk = self._generate(c)
        self._cache = (c, chunk)
        return chunk

    def _generate(self, c: int) -> _Chunk:
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, c])
        n = cfg.chunk
        sample = np.arange(c * n, (c + 1) * n, dtype=np.float64)
        u = rng.random((len(cfg.cardinalities), n))
        dense = rng.standard_normal((n, N_DENSE)).astype(np.float32)
        coin = rng.random(n)
        ids = np.empty((n, len(cfg.cardinalities)), dtype=np.int64)
        logit = np.full(n, cfg.label_bias, dtype=np.float64)
        vectors: dict[int, np.ndarray] = {}
        for t, rows in enumerate(cfg.cardinalities):
            cdf = self._cdfs[t]
            rank = np.minimum(np.searchsorted(cdf, u[t] * cdf[-1], side="right"), rows - 1)
            shift = np.floor(cfg.drift * rows * sample / 1e6).astype(np.int64)
            a, b = self._affine[t]
            table_ids = (a * ((rank + shift) % rows) + b) % rows
            ids[:, t] = table_ids
            logit += self._id_weight[t] * _hash_uniform(table_ids, self._salts[t, 0])
            if any(t in p for p in self._pairs):
                vectors[t] = np.stack(
                    [_hash_uniform(table_ids, self._salts[t, 1 + k]) for k in range(_TEACHER_DIM)],
                    axis=1,
                )
        for t1, t2 in self._pairs:
            logit += 0.5 * np.einsum("ij,ij->i", vectors[t1], vectors[t2])
        d64 = dense.astype(np.float64)
        logit += d64 @ self._dense_weight + 0.5 * np.tanh(d64[:, 0] * d64[:, 1])
        labels = (coin < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return _Chunk(ids=ids, dense=dense, labels=labels)


def _zipf_cdf(n: int, exponent: float) -> np.ndarray:
    """Unnormalised CDF of Zipf(exponent) over ranks 1..n (float64)."""
    return np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -exponent)


def _scatter(n: int, seed: int, table: int) -> tuple[int, int]:
    """(a, b) with gcd(a, n) = 1: x -> (a x + b) mod n is a bijection of 0..n-1."""
    rng = np.random.default_rng([seed, 0x5CA7, table])
    a = int(rng.integers(1, max(n, 2)))
    while math.gcd(a, n) != 1:
        a = a % n + 1
    return a, int(rng.integers(0, n))


def _hash_uniform(ids: np.ndarray, salt: np.uint64) -> np.ndarray:
    """A fixed pseudo-random value in [-1, 1) per id (splitmix64 finaliser of id ^ salt)."""
    with np.errstate(over="ignore"):
        x = ids.astype(np.uint64) ^ salt
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * (2.0 / 2**53) - 1.0
