"""A two-tower retrieval model of a user's own, on plain `nn.Embedding` / `nn.EmbeddingBag`,
trained online on raw string ids and kept live by checknrun.

It is what a recommendation team brings, nothing of checknrun's DLRM:

- a user tower: the user's own row (`nn.Embedding`, looked up by a raw user id through an id
  map) and the mean of the items the user saw last (`nn.EmbeddingBag`, mode "mean"), then an
  MLP;
- an item tower: the item's row (`nn.Embedding`, raw item id through an id map) and the sum of
  its categories (`nn.EmbeddingBag`, integer ids), then an MLP;
- the logit is the dot product of the two towers.

What checknrun needs from a model like this, all of it below:

- `build(model_config)`: the module rebuilt from the manifest's `model_config` (the factory
  `checknrun serve --model-factory examples.two_tower:build` and `ModuleSink(build)` call);
- `score(model, inputs)`: logits of a kept batch, for the served-loss measurement;
- `RequestAdapter`: what `checknrun serve --request-adapter examples.two_tower:requests` turns
  a request's examples into, and the model's output into scores;
- `train`: the training loop, published through `IncrementalCheckpointer`
  (`python -m examples.two_tower --store file://$PWD/tt-store`).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from publisher.id_map import UNKNOWN_ROW, IdMap

ARCHITECTURE = "two_tower"
#: table (module path) -> the request field whose raw ids its id map turns into rows.
ID_FEATURES = {"user": "user", "item": "item"}


@dataclass(frozen=True)
class TwoTowerConfig:
    """Everything the model is rebuilt from (the manifest's `model_config`)."""

    users: int = 2_000
    items: int = 1_000
    categories: int = 30
    dim: int = 16
    hidden: int = 32

    def to_json(self) -> dict[str, Any]:
        return {"architecture": ARCHITECTURE, **asdict(self)}

    @classmethod
    def from_json(cls, config: Mapping[str, Any]) -> TwoTowerConfig:
        if config.get("architecture") != ARCHITECTURE:
            raise ValueError(f"not a {ARCHITECTURE} config: {dict(config)}")
        return cls(**{k: int(v) for k, v in config.items() if k != "architecture"})


def _mlp(sizes: Sequence[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class TwoTower(nn.Module):
    """User tower . item tower; forward returns logits (B,)."""

    def __init__(self, config: TwoTowerConfig) -> None:
        super().__init__()
        self.config = config
        d = config.dim
        self.user = nn.Embedding(config.users, d, sparse=True)
        self.history = nn.EmbeddingBag(config.items, d, mode="mean", sparse=True)
        self.item = nn.Embedding(config.items, d, sparse=True)
        self.category = nn.EmbeddingBag(config.categories, d, mode="sum", sparse=True)
        self.user_tower = _mlp([2 * d, config.hidden, d])
        self.item_tower = _mlp([2 * d, config.hidden, d])
        for table in (self.user, self.history, self.item, self.category):
            nn.init.normal_(table.weight, std=0.1)

    def forward(
        self,
        user: torch.Tensor,
        history: torch.Tensor,
        history_offsets: torch.Tensor,
        item: torch.Tensor,
        category: torch.Tensor,
        category_offsets: torch.Tensor,
    ) -> torch.Tensor:
        u = self.user_tower(torch.cat([self.user(user), self.history(history, history_offsets)], 1))
        v = self.item_tower(
            torch.cat([self.item(item), self.category(category, category_offsets)], 1)
        )
        logits: torch.Tensor = (u * v).sum(1)
        return logits


def build(model_config: Mapping[str, Any]) -> TwoTower:
    """The factory: the model a manifest's `model_config` describes."""
    return TwoTower(TwoTowerConfig.from_json(model_config))


def optimizers(model: TwoTower) -> list[torch.optim.Optimizer]:
    """Adagrad on the (sparse) tables, Adam on the towers: both sound for incremental
    checkpoints (only looked-up rows change)."""
    tables = [model.user.weight, model.history.weight, model.item.weight, model.category.weight]
    towers = [*model.user_tower.parameters(), *model.item_tower.parameters()]
    return [torch.optim.Adagrad(tables, lr=0.05), torch.optim.Adam(towers, lr=0.003)]


def score(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Logits of a kept batch (`inputs` are the forward's arguments)."""
    out: torch.Tensor = model(*inputs)
    return out


# --- the online stream ---------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """One batch of events: raw ids as they arrive, labels."""

    users: list[str]
    items: list[str]
    history: list[list[int]]  # item rows the user saw (already rows: a feature of the app)
    categories: list[list[int]]
    labels: torch.Tensor  # float32 (B,)


class Stream:
    """A deterministic click stream with a hidden truth: users and items have latent vectors,
    a click is more likely the closer they are; new users and items keep arriving."""

    def __init__(self, config: TwoTowerConfig, *, seed: int = 0, batch: int = 64) -> None:
        self.config = config
        self.batch = batch
        self.rng = np.random.default_rng(seed)
        self.user_vectors = self.rng.normal(size=(config.users * 2, 4))
        self.item_vectors = self.rng.normal(size=(config.items * 2, 4))
        self.item_categories = self.rng.integers(0, config.categories, size=(config.items * 2, 2))
        self.step = 0

    def next(self) -> Batch:
        """The next batch: ids drawn from a pool that grows with time (Zipf-like popularity)."""
        self.step += 1
        pool_users = min(len(self.user_vectors), 50 + 10 * self.step)
        pool_items = min(len(self.item_vectors), 30 + 5 * self.step)
        users = (self.rng.zipf(1.3, self.batch) - 1) % pool_users
        items = (self.rng.zipf(1.3, self.batch) - 1) % pool_items
        logits = (self.user_vectors[users] * self.item_vectors[items]).sum(1) - 0.5
        clicks = self.rng.random(self.batch) < 1 / (1 + np.exp(-logits))
        lengths = self.rng.integers(0, 4, self.batch)
        history = [list(self.rng.integers(1, self.config.items, int(n)).tolist()) for n in lengths]
        return Batch(
            users=[f"u{u}" for u in users],
            items=[f"i{i}" for i in items],
            history=history,
            categories=[list(map(int, self.item_categories[i])) for i in items],
            labels=torch.from_numpy(clicks.astype(np.float32)),
        )


class RowAssigner:
    """Raw ids -> rows of one table: a new id takes the next free row while there is one, then
    row 0 (the unknown row). A real system evicts (trainer/id_space.py); this example only
    fills."""

    def __init__(self, id_map: IdMap) -> None:
        self.id_map = id_map

    def rows(self, keys: Sequence[str]) -> torch.Tensor:
        free = self.id_map.free_rows()
        taken = 0
        for key in dict.fromkeys(keys):
            if self.id_map.row_of(key) is None and taken < len(free):
                self.id_map.assign(key, int(free[taken]))
                taken += 1
        return torch.from_numpy(self.id_map.lookup(list(keys)))


def bag(lists: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat values and offsets of one bag per example."""
    lengths = torch.tensor([len(x) for x in lists], dtype=torch.int64)
    offsets = torch.zeros(len(lists), dtype=torch.int64)
    if len(lists) > 1:
        offsets[1:] = torch.cumsum(lengths[:-1], 0)
    values = torch.tensor([v for x in lists for v in x], dtype=torch.int64)
    return values, offsets


def inputs_of(batch: Batch, users: torch.Tensor, items: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The forward's arguments for a batch whose raw ids were mapped to `users` and `items`."""
    history, history_offsets = bag(batch.history)
    category, category_offsets = bag(batch.categories)
    return users, history, history_offsets, items, category, category_offsets


# --- serving -------------------------------------------------------------------------------


class RequestAdapter:
    """Requests of `checknrun serve --model-factory examples.two_tower:build
    --request-adapter examples.two_tower:requests`.

    An example is `{"user": "u12", "item": "i7", "history": [3, 9], "categories": [1, 4]}`;
    the server maps `user` and `item` through the served version's id maps first (`id_features`),
    so `inputs` gets their rows (0 for an id the version does not know).
    """

    #: request field -> the table whose id map turns its raw ids into rows.
    id_features = ID_FEATURES

    def __init__(self, model_config: Mapping[str, Any]) -> None:
        self.config = TwoTowerConfig.from_json(model_config)

    def inputs(self, examples: Sequence[Mapping[str, Any]]) -> tuple[torch.Tensor, ...]:
        """The forward's arguments; ValueError names what is wrong with an example."""
        users, items, history, categories = [], [], [], []
        for i, example in enumerate(examples):
            users.append(_row(example.get("user"), i, "user"))
            items.append(_row(example.get("item"), i, "item"))
            history.append(_ids(example.get("history", []), i, "history", self.config.items))
            categories.append(
                _ids(example.get("categories", []), i, "categories", self.config.categories)
            )
        history_values, history_offsets = bag(history)
        category_values, category_offsets = bag(categories)
        return (
            torch.tensor(users, dtype=torch.int64),
            history_values,
            history_offsets,
            torch.tensor(items, dtype=torch.int64),
            category_values,
            category_offsets,
        )

    def scores(self, output: torch.Tensor) -> torch.Tensor:
        """Click probabilities."""
        return torch.sigmoid(output)


def requests(model_config: Mapping[str, Any]) -> RequestAdapter:
    """The request adapter of a served version (`--request-adapter examples.two_tower:requests`)."""
    return RequestAdapter(model_config)


def _row(value: object, i: int, name: str) -> int:
    if value is None:
        return UNKNOWN_ROW
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"example {i}: {name!r} was not mapped to a row")
    return value


def _ids(value: object, i: int, name: str, rows: int) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < rows for v in value
    ):
        raise ValueError(f"example {i}: {name!r} needs a list of integer ids in [0, {rows})")
    return list(value)


# --- training online: the loop a user writes -----------------------------------------------


def train(
    store: str,
    *,
    model_name: str = "two_tower",
    steps: int = 300,
    codec: str = "auto",
    bus: str | None = None,
    interval_samples: int = 3_200,
) -> list[int]:
    """Train the model online on the example stream and publish a version every
    `interval_samples`: the loop a user of `IncrementalCheckpointer` writes. Returns the
    versions committed."""
    # Here, not at the top: a server importing `build` and `requests` needs no trainer.
    from trainer.checkpointer import CheckpointRecord, IncrementalCheckpointer

    def published(record: CheckpointRecord) -> None:
        loss = record.served_loss
        measured = "" if loss is None else f", served AUC loss {100 * loss.auc_rel_loss:+.4f}%"
        print(
            f"v{record.version}: {record.published_kind} {record.codec}, {record.bytes:,} bytes"
            f"{measured}",
            file=sys.stderr,
        )

    config = TwoTowerConfig()
    model = TwoTower(config)
    opts = optimizers(model)
    # Raw ids get rows through one id map per table; every version carries the maps' entries
    # of the rows it carries, so servers map raw ids with the version that scores them.
    id_maps = {"user": IdMap(config.users), "item": IdMap(config.items)}
    assign = {table: RowAssigner(m) for table, m in id_maps.items()}
    stream = Stream(config)
    ckpt = IncrementalCheckpointer(
        model,
        opts,
        store=store,
        model_name=model_name,
        codec=codec,  # "auto": each version's bits from its measured served loss
        score=score,  # how the served-loss measurement scores a kept batch
        interval_samples=interval_samples,
        model_config=config.to_json(),  # what `build` gets on the serving side
        id_maps=id_maps,
        bus=bus,
        on_published=published,
    )
    for step in range(steps):
        batch = stream.next()
        inputs = inputs_of(
            batch, assign["user"].rows(batch.users), assign["item"].rows(batch.items)
        )
        loss = functional.binary_cross_entropy_with_logits(model(*inputs), batch.labels)
        for opt in opts:
            opt.zero_grad()
        torch.autograd.backward(loss)
        for opt in opts:
            opt.step()
        ckpt.keep_scored(inputs, batch.labels)  # the window the served loss is measured on
        ckpt.step(len(batch.labels))  # after the optimizer steps, before the next forward
        ckpt.maybe_checkpoint(reader={"step": step + 1})  # where a resume would start
    ckpt.checkpoint_now(reader={"step": steps})  # close() publishes only what was taken
    ckpt.close()
    return [r.version for r in ckpt.records if r.version is not None]


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m examples.two_tower --store URL [--steps N] [--bus URL]`."""
    parser = argparse.ArgumentParser(prog="python -m examples.two_tower", description=train.__doc__)
    parser.add_argument("--store", required=True, help="file:///PATH or s3://BUCKET/PREFIX")
    parser.add_argument("--bus", help="file:///PATH.log or kafka://HOST:PORT/TOPIC")
    parser.add_argument("--model", default="two_tower", help="model name (default two_tower)")
    parser.add_argument("--steps", type=int, default=300, help="batches of 64 (default 300)")
    parser.add_argument("--codec", default="auto", help="int4, int8, fp32, auto (default)...")
    args = parser.parse_args(argv)
    # torch's notice on every sparse Adagrad step (as `checknrun train` does).
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    versions = train(
        args.store, model_name=args.model, steps=args.steps, codec=args.codec, bus=args.bus
    )
    print(f"published versions {versions[0]}..{versions[-1]} of {args.model} to {args.store}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
