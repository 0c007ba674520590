"""A synthetic training run that publishes real versions: for tests and the load bench.

It stands in for the trainer where only the publishing pattern matters: a DLRM whose embedding
rows are touched with Zipf-distributed ids (a few hot rows, a long tail) and whose dense
parameters drift, published through the real `CheckpointPublisher` (encode, commit, announce).
Only tools import this module (tests, `bench.serving`); the serving code never does, so the
server still depends on the publisher's read side only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from publisher.dlrm import DLRM, DLRMConfig, SparseBatch, SparseFeature, table_weight_names
from publisher.state_dicts import module_tensors
from publisher.store import ObjectStore
from publisher.write.job_publishing import CheckpointPublisher
from publisher.write.publishing import PublishResult
from publisher.write.snapshot import Snapshot, TableRows
from schemas.announcement import Announcement
from schemas.manifest import Position


def small_config(
    *,
    rows: tuple[int, ...] = (1000, 500),
    bag_rows: int | None = 20,
    dim: int = 8,
    n_dense: int = 2,
    hashing: bool = False,
) -> DLRMConfig:
    """A small DLRM config: sparse features `f0, f1...`, an optional bag `tags`, dense `d0...`."""
    sparse = [SparseFeature(f"f{i}", r) for i, r in enumerate(rows)]
    if bag_rows is not None:
        sparse.append(SparseFeature("tags", bag_rows, bag=True))
    return DLRMConfig(
        sparse=tuple(sparse),
        dense=tuple(f"d{i}" for i in range(n_dense)),
        embedding_dim=dim,
        bottom_mlp=(16,),
        top_mlp=(16,),
        hashing=hashing,
    )


def random_examples(config: DLRMConfig, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` valid examples for `config`, as a predict request's `examples`."""
    rng = np.random.default_rng(seed)
    out: list[dict[str, Any]] = []
    for _ in range(n):
        ex: dict[str, Any] = {d: float(rng.normal()) for d in config.dense}
        for f in config.sparse:
            if f.bag:
                ex[f.name] = [int(x) for x in rng.integers(0, f.rows, int(rng.integers(0, 4)))]
            else:
                ex[f.name] = int(rng.integers(0, f.rows))
        out.append(ex)
    return out


def model_scores(model: DLRM, examples: list[dict[str, Any]]) -> np.ndarray:
    """What a trainer-side model predicts for `examples` (sigmoid), for comparisons."""
    config = model.config
    dense = torch.tensor(
        [[float(ex[d]) for d in config.dense] for ex in examples], dtype=torch.float32
    ).reshape(len(examples), len(config.dense))
    sparse: dict[str, SparseBatch] = {}
    for f in config.sparse:
        ids = [ex[f.name] if f.bag else [ex[f.name]] for ex in examples]
        lengths = [len(i) for i in ids]
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        flat = [v for i in ids for v in i]
        sparse[f.name] = SparseBatch(
            torch.tensor(flat, dtype=torch.int64), torch.from_numpy(offsets)
        )
    with torch.no_grad():
        return torch.sigmoid(model(dense, sparse)).numpy()


@dataclass
class SyntheticRun:
    """A model, a publisher, and a training loop that dirties rows like a sparse optimizer."""

    store: ObjectStore
    name: str
    config: DLRMConfig
    codec: str = "fp32"
    seed: int = 0
    announce: Callable[[Announcement], None] | None = None
    zipf_a: float = 1.2
    model: DLRM = field(init=False)
    publisher: CheckpointPublisher = field(init=False)
    step: int = 0
    published: list[PublishResult] = field(default_factory=list)

    def __post_init__(self) -> None:
        torch.manual_seed(self.seed)
        self.model = DLRM(self.config)
        self.model.requires_grad_(False)
        self._rng = np.random.default_rng(self.seed)
        self._weights = table_weight_names(self.model)
        self._dirty = {t: np.zeros(self.table(t).shape[0], dtype=bool) for t in self._weights}
        self.publisher = CheckpointPublisher(self.store, self.name, announce=self.announce)

    def table(self, name: str) -> torch.Tensor:
        weight: torch.Tensor = self.model.state_dict(keep_vars=True)[self._weights[name]].data
        return weight

    def train(self, steps: int = 1, rows_per_step: int = 64) -> None:
        """Touch Zipf-chosen rows of every table and nudge the dense parameters."""
        for _ in range(steps):
            self.step += 1
            for name in self._weights:
                weight = self.table(name)
                rows = weight.shape[0]
                ids = np.unique((self._rng.zipf(self.zipf_a, rows_per_step) - 1) % rows)
                noise = self._rng.normal(0, 0.01, (len(ids), weight.shape[1]))
                weight[torch.from_numpy(ids)] += torch.from_numpy(noise.astype(np.float32))
                self._dirty[name][ids] = True
            for p in (*self.model.bottom.parameters(), *self.model.top.parameters()):
                p.data += 0.001 * torch.randn_like(p.data)

    def touch_rows(self, table: str, n_rows: int) -> None:
        """Dirty exactly `n_rows` distinct rows of `table` (apply-time vs delta-size sweeps)."""
        weight = self.table(table)
        ids = np.sort(self._rng.choice(weight.shape[0], size=n_rows, replace=False))
        noise = self._rng.normal(0, 0.01, (n_rows, weight.shape[1])).astype(np.float32)
        weight[torch.from_numpy(ids)] += torch.from_numpy(noise)
        self._dirty[table][ids] = True
        self.step += 1

    def snapshot(
        self,
        kind: Literal["full", "delta"] = "delta",
        relative_to: Literal["parent", "baseline"] | None = "parent",
    ) -> Snapshot:
        tables = []
        for name in self._weights:
            weight = self.table(name).numpy()
            if kind == "full":
                ids = np.arange(weight.shape[0], dtype=np.int64)
            else:
                ids = np.flatnonzero(self._dirty[name]).astype(np.int64)
            tables.append(
                TableRows(
                    name=name,
                    table_rows=weight.shape[0],
                    codec=self.codec,
                    row_ids=ids,
                    values=weight[ids].copy(),
                    aux=np.zeros((len(ids), 0), dtype=np.float32),
                )
            )
        skip = set(self._weights.values())
        return Snapshot(
            kind=kind,
            relative_to=None if kind == "full" else relative_to,
            policy="one-shot" if relative_to == "baseline" else "consecutive",
            tables=tuple(tables),
            position=Position(step=self.step, samples_seen=self.step * 128),
            dense=module_tensors(self.model, skip),
            model_config=self.config.to_json(),
            taken_at=time.time(),
        )

    def publish(
        self,
        kind: Literal["full", "delta"] = "delta",
        relative_to: Literal["parent", "baseline"] | None = "parent",
    ) -> PublishResult:
        """Commit (and announce) the rows dirtied since the last publish (or everything)."""
        result = self.publisher.publish(self.snapshot(kind, relative_to))
        if relative_to != "baseline" or kind == "full":
            for dirty in self._dirty.values():
                dirty[:] = False
        self.published.append(result)
        return result

    def train_and_publish(
        self,
        kind: Literal["full", "delta"] = "delta",
        *,
        announce: bool = True,
        relative_to: Literal["parent", "baseline"] | None = "parent",
    ) -> int:
        """Two training steps, then publish (optionally without announcing); the new version."""
        self.train(2)
        saved = self.publisher.announce
        if not announce:
            self.publisher.announce = None
        try:
            return self.publish(kind, relative_to).ref.version
        finally:
            self.publisher.announce = saved

    def close(self) -> None:
        self.publisher.close()
