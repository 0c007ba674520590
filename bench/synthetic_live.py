"""A small model trained from raw ids, published by the real `IncrementalCheckpointer` with its
id maps: for the server's tests of raw-id predictions (and anything else that needs a store of
a model trained from raw events without Kafka).

It keeps the rule every version's id maps depend on (docs/FORMAT.md section 7): each change to
a map touches a row the checkpointer sees dirty. An id is admitted (given a free row) when an
event first names it and is then looked up in the same training step; its count grows with a
lookup of its row; an evicted id's row is re-initialised and marked dirty. The trainer's own
admission and eviction policy (trainer/id_space.py) is richer; here the tests choose.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from publisher.dlrm import DLRM, TABLE_PREFIX, DLRMConfig, SparseBatch, SparseFeature
from publisher.id_map import UNKNOWN_ROW, IdMap, canonical_key
from publisher.live_features import LiveFeature, LiveSpec
from publisher.store import ObjectStore
from trainer.checkpointer import IncrementalCheckpointer

Event = Mapping[str, Any]

LIVE_SPEC = LiveSpec(
    features=(LiveFeature("user"), LiveFeature("item"), LiveFeature("genres", bag=True)),
    count_features=("user", "item"),
)


def live_config(spec: LiveSpec = LIVE_SPEC, rows: int = 32, dim: int = 4) -> DLRMConfig:
    """The DLRM of `spec`: one table of `rows` rows per feature, the derived dense inputs."""
    return DLRMConfig(
        sparse=tuple(SparseFeature(f.name, rows, f.bag) for f in spec.features),
        dense=spec.dense_names,
        embedding_dim=dim,
        bottom_mlp=(8,),
        top_mlp=(8,),
        extra={"live": spec.to_json()},
    )


@dataclass
class SyntheticLiveRun:
    """A live model, its id maps and a checkpointer publishing both (fp32 rows by default, so
    served rows are bitwise the trainer's)."""

    store: ObjectStore | str
    name: str
    spec: LiveSpec = LIVE_SPEC
    rows: int = 32
    codec: str = "fp32"
    bus: str | None = None
    seed: int = 0
    config: DLRMConfig = field(init=False)
    model: DLRM = field(init=False)
    id_maps: dict[str, IdMap] = field(init=False)
    checkpointer: IncrementalCheckpointer = field(init=False)

    def __post_init__(self) -> None:
        torch.manual_seed(self.seed)
        self.config = live_config(self.spec, self.rows)
        self.model = DLRM(self.config)
        hashed = self.spec.id_space == "hash"
        self.id_maps = {
            TABLE_PREFIX + f.name: IdMap(self.rows, hashed=hashed) for f in self.spec.features
        }
        self._optimizer = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.checkpointer = IncrementalCheckpointer(
            self.model,
            [self._optimizer],
            store=self.store,
            model_name=self.name,
            policy="consecutive",
            codec=self.codec,
            model_config=self.config.to_json(),
            bus=self.bus,
            id_maps=self.id_maps,
            preallocate=False,
        )

    def id_map(self, feature: str) -> IdMap:
        return self.id_maps[TABLE_PREFIX + feature]

    # --- training --------------------------------------------------------------------------

    def train(self, events: Sequence[Event], *, admit: bool = True) -> None:
        """One step on `events`: unknown ids are admitted first when `admit` (and a row is
        free), every id's row is looked up, then counts and last-seen times move."""
        if admit:
            for event in events:
                for feature in self.spec.features:
                    for key in self._keys(event, feature):
                        self._admit(feature.name, key)
        batch = self.inputs(events)
        labels = torch.tensor([float(e.get("label", 1.0)) for e in events])
        loss = nn.functional.binary_cross_entropy_with_logits(
            self.model(batch.dense, batch.sparse), labels
        )
        self._optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        self._optimizer.step()
        for feature in self.spec.features:
            id_map = self.id_map(feature.name)
            for event in events:
                for row in id_map.lookup(self._keys(event, feature)).tolist():
                    if id_map.hashed or row != UNKNOWN_ROW:
                        id_map.counts[row] += 1
                        id_map.last_seen[row] = float(event["ts"])
        self.checkpointer.step(len(events))

    def evict(self, feature: str, key: str) -> int:
        """Evict `key`: its row is re-initialised and marked dirty; returns the row."""
        id_map = self.id_map(feature)
        row = id_map.row_of(key)
        assert row is not None, f"{key!r} holds no row of {feature!r}"
        id_map.release(row)
        table = self.model.embeddings[feature]
        assert isinstance(table, nn.EmbeddingBag)
        with torch.no_grad():  # the init DLRM gives every row
            bound = 1.0 / table.embedding_dim**0.5
            table.weight[row].uniform_(-bound, bound)
        self.checkpointer.tracked.tracker.mark(TABLE_PREFIX + feature, np.array([row]))
        return row

    def _admit(self, feature: str, key: str) -> None:
        id_map = self.id_map(feature)
        if id_map.hashed or id_map.row_of(key) is not None:
            return
        free = id_map.free_rows()
        if free.size:
            id_map.assign(key, int(free[0]))

    @staticmethod
    def _keys(event: Event, feature: LiveFeature) -> list[str]:
        value = event.get(feature.name)
        if value is None:
            return []
        return [canonical_key(v) for v in (value if feature.bag else [value])]

    # --- what the model predicts -------------------------------------------------------------

    def inputs(self, events: Sequence[Event]) -> _Inputs:
        """The model inputs of `events` by the trainer's rule: ids through the maps (no id or
        an unknown one: row 0), dense from `ts`, the prior counts and the dense features."""
        n = len(events)
        sparse: dict[str, SparseBatch] = {}
        prior: dict[str, np.ndarray] = {}
        for feature in self.spec.features:
            id_map = self.id_map(feature.name)
            keys = [self._keys(e, feature) for e in events]
            if feature.bag:
                lengths = np.array([len(k) for k in keys], dtype=np.int64)
                flat = id_map.lookup([k for ks in keys for k in ks])
                offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
                sparse[feature.name] = SparseBatch(
                    torch.from_numpy(flat), torch.from_numpy(offsets)
                )
                continue
            rows = np.array(
                [int(id_map.lookup(k)[0]) if k else UNKNOWN_ROW for k in keys], dtype=np.int64
            )
            sparse[feature.name] = SparseBatch(
                torch.from_numpy(rows), torch.arange(n, dtype=torch.int64)
            )
            known = np.ones(n, dtype=bool) if id_map.hashed else rows != UNKNOWN_ROW
            prior[feature.name] = np.where(known, id_map.counts[rows], 0)
        ts = np.array([float(e["ts"]) for e in events])
        names = self.spec.dense_feature_names
        values = np.array(
            [[math.nan if e.get(d) is None else float(e[d]) for d in names] for e in events]
        ).reshape(n, len(names))
        return _Inputs(torch.from_numpy(self.spec.dense(ts, prior, values)), sparse)

    def scores(self, events: Sequence[Event]) -> np.ndarray:
        """What the trainer's model predicts for `events` now (sigmoid)."""
        batch = self.inputs(events)
        with torch.no_grad():
            return torch.sigmoid(self.model(batch.dense, batch.sparse)).numpy()

    # --- publishing ----------------------------------------------------------------------------

    def publish(self, *, full: bool = False) -> int:
        """Checkpoint now and wait until it is committed; the version."""
        return self.checkpointer.commit_now(force_full=full)

    def close(self) -> None:
        self.checkpointer.close()


@dataclass(frozen=True)
class _Inputs:
    dense: torch.Tensor
    sparse: dict[str, SparseBatch]
