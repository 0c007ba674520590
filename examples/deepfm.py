"""A DeepFM-style ranker of a user's own on a TorchRec `EmbeddingBagCollection` (unsharded),
trained online on integer ids and dense features, and kept live by checknrun.

- sparse features `user`, `item` (one id each) and `tags` (a bag), one table each in one
  `EmbeddingBagCollection` fed a `KeyedJaggedTensor`;
- first order: a dim-1 table `linear` over every feature's ids (offset per feature), also in
  the collection;
- second order: the factorisation machine over the pooled embeddings;
- deep part: an MLP over the pooled embeddings and the dense features.

`build`, `score` and `requests` are what checknrun needs (see examples/two_tower.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

ARCHITECTURE = "deepfm"
FEATURES = ("user", "item", "tags")


@dataclass(frozen=True)
class DeepFMConfig:
    """Everything the model is rebuilt from (the manifest's `model_config`)."""

    users: int = 500
    items: int = 300
    tags: int = 40
    dim: int = 8
    dense: int = 3
    hidden: int = 32

    def to_json(self) -> dict[str, Any]:
        return {"architecture": ARCHITECTURE, **asdict(self)}

    @classmethod
    def from_json(cls, config: Mapping[str, Any]) -> DeepFMConfig:
        if config.get("architecture") != ARCHITECTURE:
            raise ValueError(f"not a {ARCHITECTURE} config: {dict(config)}")
        return cls(**{k: int(v) for k, v in config.items() if k != "architecture"})

    @property
    def rows(self) -> dict[str, int]:
        return {"user": self.users, "item": self.items, "tags": self.tags}


class DeepFM(nn.Module):
    """Linear + FM + deep; forward(features: KJT, dense: (B, n)) returns logits (B,)."""

    def __init__(self, config: DeepFMConfig) -> None:
        super().__init__()
        self.config = config
        rows = config.rows
        tables = [
            EmbeddingBagConfig(
                name=name,
                embedding_dim=config.dim,
                num_embeddings=rows[name],
                feature_names=[name],
            )
            for name in FEATURES
        ]
        tables.append(
            EmbeddingBagConfig(
                name="linear",
                embedding_dim=1,
                num_embeddings=sum(rows.values()),
                feature_names=["linear"],
            )
        )
        self.bags = EmbeddingBagCollection(tables=tables)
        self.deep = nn.Sequential(
            nn.Linear(len(FEATURES) * config.dim + config.dense, config.hidden),
            nn.ReLU(),
            nn.Linear(config.hidden, 1),
        )
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, features: KeyedJaggedTensor, dense: torch.Tensor) -> torch.Tensor:
        pooled = self.bags(features).to_dict()
        vectors = torch.stack([pooled[name] for name in FEATURES], dim=1)  # (B, F, d)
        first = pooled["linear"].squeeze(1)
        fm = 0.5 * (vectors.sum(1).pow(2) - vectors.pow(2).sum(1)).sum(1)
        deep = self.deep(torch.cat([vectors.flatten(1), dense], 1)).squeeze(1)
        out: torch.Tensor = first + fm + deep + self.bias
        return out


def build(model_config: Mapping[str, Any]) -> DeepFM:
    """The factory: the model a manifest's `model_config` describes."""
    return DeepFM(DeepFMConfig.from_json(model_config))


def optimizers(model: DeepFM) -> list[torch.optim.Optimizer]:
    """Adagrad on the tables (TorchRec's bags have dense gradients: a row not looked up gets a
    zero gradient, which Adagrad leaves alone), Adam on the rest."""
    rest = [*model.deep.parameters(), model.bias]
    return [
        torch.optim.Adagrad(model.bags.parameters(), lr=0.05),
        torch.optim.Adam(rest, lr=0.003),
    ]


def score(model: nn.Module, inputs: tuple[KeyedJaggedTensor, torch.Tensor]) -> torch.Tensor:
    """Logits of a kept batch (`inputs` are the forward's arguments)."""
    out: torch.Tensor = model(*inputs)
    return out


def features(
    config: DeepFMConfig, users: Sequence[int], items: Sequence[int], tags: Sequence[Sequence[int]]
) -> KeyedJaggedTensor:
    """The KJT of a batch: one id of `user` and `item`, a bag of `tags`, and the first-order
    ids (every feature's ids, offset into the shared `linear` table)."""
    n = len(users)
    tag_values = [t for row in tags for t in row]
    tag_lengths = [len(row) for row in tags]
    item_base, tag_base = config.users, config.users + config.items
    linear = [
        [u, item_base + i, *(tag_base + t for t in row)]
        for u, i, row in zip(users, items, tags, strict=True)
    ]
    values = [*users, *items, *tag_values, *(v for row in linear for v in row)]
    lengths = [*([1] * n), *([1] * n), *tag_lengths, *(len(row) for row in linear)]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[*FEATURES, "linear"],
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int32),
    )


# --- the online stream ---------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """The forward's arguments of one batch of events, and the labels."""

    features: KeyedJaggedTensor
    dense: torch.Tensor
    labels: torch.Tensor

    @property
    def inputs(self) -> tuple[KeyedJaggedTensor, torch.Tensor]:
        return self.features, self.dense


class Stream:
    """A deterministic click stream: hidden user and item vectors, a few informative dense
    features, popular ids drawn more often."""

    def __init__(self, config: DeepFMConfig, *, seed: int = 0, batch: int = 64) -> None:
        self.config = config
        self.batch = batch
        self.rng = np.random.default_rng(seed)
        self.user_vectors = self.rng.normal(size=(config.users, 4))
        self.item_vectors = self.rng.normal(size=(config.items, 4))

    def next(self) -> Batch:
        c, n = self.config, self.batch
        users = (self.rng.zipf(1.2, n) - 1) % c.users
        items = (self.rng.zipf(1.2, n) - 1) % c.items
        tags = [self.rng.integers(0, c.tags, int(k)).tolist() for k in self.rng.integers(0, 4, n)]
        dense = self.rng.normal(size=(n, c.dense)).astype(np.float32)
        logits = (self.user_vectors[users] * self.item_vectors[items]).sum(1) + dense[:, 0]
        clicks = self.rng.random(n) < 1 / (1 + np.exp(-logits))
        return Batch(
            features(c, users.tolist(), items.tolist(), tags),
            torch.from_numpy(dense),
            torch.from_numpy(clicks.astype(np.float32)),
        )


# --- serving -------------------------------------------------------------------------------


class RequestAdapter:
    """Requests of `checknrun serve --model-factory examples.deepfm:build --request-adapter
    examples.deepfm:requests`: `{"user": 3, "item": 17, "tags": [1, 5], "dense": [0.1, 0, 2]}`."""

    id_features: Mapping[str, str] = {}

    def __init__(self, model_config: Mapping[str, Any]) -> None:
        self.config = DeepFMConfig.from_json(model_config)

    def inputs(
        self, examples: Sequence[Mapping[str, Any]]
    ) -> tuple[KeyedJaggedTensor, torch.Tensor]:
        """The forward's arguments; ValueError names what is wrong with an example."""
        c = self.config
        users, items, tags, dense = [], [], [], []
        for i, example in enumerate(examples):
            users.append(_id(example.get("user"), i, "user", c.users))
            items.append(_id(example.get("item"), i, "item", c.items))
            row = example.get("tags", [])
            if not isinstance(row, list):
                raise ValueError(f"example {i}: 'tags' needs a list of ids")
            tags.append([_id(t, i, "tags", c.tags) for t in row])
            values = example.get("dense")
            if (
                not isinstance(values, list)
                or len(values) != c.dense
                or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
            ):
                raise ValueError(f"example {i}: 'dense' needs {c.dense} numbers")
            dense.append([float(v) for v in values])
        return features(c, users, items, tags), torch.tensor(dense, dtype=torch.float32)

    def scores(self, output: torch.Tensor) -> torch.Tensor:
        """Click probabilities."""
        return torch.sigmoid(output)


def requests(model_config: Mapping[str, Any]) -> RequestAdapter:
    """The request adapter of a served version (`--request-adapter examples.deepfm:requests`)."""
    return RequestAdapter(model_config)


def _id(value: object, i: int, name: str, rows: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < rows:
        raise ValueError(f"example {i}: {name!r} needs an integer id in [0, {rows})")
    return value
