"""The two user models of examples/ trained online through `IncrementalCheckpointer`, for the
tests that follow them (a `Subscriber`, `checknrun serve --model-factory`, a framework).

    run = UserRun.two_tower(store_url, "tt", codec="int4")
    run.train(steps=10)
    version = run.checkpoint()                      # a committed version
    batch = run.requests(16)                        # examples as a client sends them
    scores = run.restored_scores(version, batch)    # what that version's restore scores

Both are trained from a deterministic stream; the two-tower model maps raw string ids through
id maps (a model of an open id space), the DeepFM model takes integer ids and dense features.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from examples import deepfm, two_tower
from publisher.id_map import IdMap
from publisher.read import restore
from publisher.state_dicts import weight_key
from publisher.store import open_store
from trainer.checkpointer import IncrementalCheckpointer

#: samples per interval: a version every 10 steps of 64.
INTERVAL = 640


@dataclass
class UserRun:
    """One user model, its stream and its checkpointer."""

    name: str
    store_url: str
    model: nn.Module
    optimizers: list[torch.optim.Optimizer]
    checkpointer: IncrementalCheckpointer
    next_batch: Callable[[], tuple[tuple[Any, ...], torch.Tensor]]
    #: examples as a client sends them, and the forward's inputs for them from id maps.
    make_requests: Callable[[int], list[dict[str, Any]]]
    build: Callable[[Mapping[str, Any]], nn.Module]
    adapter: Callable[[Mapping[str, Any]], Any]
    steps: int = 0

    @classmethod
    def two_tower(
        cls,
        store_url: str,
        name: str,
        config: two_tower.TwoTowerConfig | None = None,
        **checkpointer: Any,
    ) -> UserRun:
        config = config or two_tower.TwoTowerConfig(
            users=400, items=200, categories=12, dim=8, hidden=16
        )
        model = two_tower.TwoTower(config)
        optimizers = two_tower.optimizers(model)
        maps = {"user": IdMap(config.users), "item": IdMap(config.items)}
        assign = {table: two_tower.RowAssigner(m) for table, m in maps.items()}
        stream = two_tower.Stream(config, seed=1)

        def next_batch() -> tuple[tuple[Any, ...], torch.Tensor]:
            b = stream.next()
            rows = two_tower.inputs_of(
                b, assign["user"].rows(b.users), assign["item"].rows(b.items)
            )
            return rows, b.labels

        rng = np.random.default_rng(7)

        def requests(n: int) -> list[dict[str, Any]]:
            return [
                {
                    # Some ids the trainer has met, some it has not (the unknown row).
                    "user": f"u{int(rng.integers(0, 120))}",
                    "item": f"i{int(rng.integers(0, 80))}",
                    "history": rng.integers(0, config.items, 2).tolist(),
                    "categories": rng.integers(0, config.categories, 2).tolist(),
                }
                for _ in range(n)
            ]

        ckpt = IncrementalCheckpointer(
            model,
            optimizers,
            store=store_url,
            model_name=name,
            interval_samples=INTERVAL,
            model_config=config.to_json(),
            id_maps=maps,
            **checkpointer,
        )
        return cls(
            name,
            store_url,
            model,
            optimizers,
            ckpt,
            next_batch,
            requests,
            two_tower.build,
            two_tower.requests,
        )

    @classmethod
    def deepfm(
        cls,
        store_url: str,
        name: str,
        config: deepfm.DeepFMConfig | None = None,
        **checkpointer: Any,
    ) -> UserRun:
        config = config or deepfm.DeepFMConfig(
            users=200, items=120, tags=16, dim=8, dense=3, hidden=16
        )
        model = deepfm.DeepFM(config)
        optimizers = deepfm.optimizers(model)
        stream = deepfm.Stream(config, seed=1)

        def next_batch() -> tuple[tuple[Any, ...], torch.Tensor]:
            b = stream.next()
            return b.inputs, b.labels

        rng = np.random.default_rng(7)

        def requests(n: int) -> list[dict[str, Any]]:
            return [
                {
                    "user": int(rng.integers(0, config.users)),
                    "item": int(rng.integers(0, config.items)),
                    "tags": rng.integers(0, config.tags, int(rng.integers(0, 3))).tolist(),
                    "dense": rng.normal(size=config.dense).round(3).tolist(),
                }
                for _ in range(n)
            ]

        ckpt = IncrementalCheckpointer(
            model,
            optimizers,
            store=store_url,
            model_name=name,
            interval_samples=INTERVAL,
            model_config=config.to_json(),
            **checkpointer,
        )
        return cls(
            name,
            store_url,
            model,
            optimizers,
            ckpt,
            next_batch,
            requests,
            deepfm.build,
            deepfm.requests,
        )

    # --- training ----------------------------------------------------------------------------

    def train(self, steps: int) -> None:
        """`steps` optimizer steps, checkpointing when an interval is due."""
        for _ in range(steps):
            inputs, labels = self.next_batch()
            loss = functional.binary_cross_entropy_with_logits(self.model(*inputs), labels)
            for optimizer in self.optimizers:
                optimizer.zero_grad()
            loss.backward()
            for optimizer in self.optimizers:
                optimizer.step()
            self.steps += 1
            self.checkpointer.step(int(labels.shape[0]))
            self.checkpointer.maybe_checkpoint(reader={"offset": self.steps})

    def checkpoint(self) -> int:
        """A version of the state now, committed; returns its number."""
        self.checkpointer.checkpoint_now(reader={"offset": self.steps})
        self.checkpointer.flush()
        version = self.checkpointer.last_version
        assert version is not None
        return version

    def close(self) -> None:
        self.checkpointer.close()

    # --- what a version scores ---------------------------------------------------------------

    def requests(self, n: int) -> list[dict[str, Any]]:
        return self.make_requests(n)

    def restored(self, version: int) -> tuple[nn.Module, dict[str, IdMap], dict[str, Any]]:
        """The model at `version` rebuilt from its restore: module, id maps, model_config."""
        with open_store(self.store_url, create=False) as store:
            state = restore(store, self.name, version)
        module = self.build(state.manifest.model_config_)
        weights = {weight_key(n): torch.from_numpy(t.weights) for n, t in state.tables.items()}
        dense = {k: torch.from_numpy(v) for k, v in state.dense.items()}
        module.load_state_dict({**weights, **dense}, strict=True)
        module.eval()
        return module, dict(state.id_maps), dict(state.manifest.model_config_)

    def restored_scores(self, version: int, examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """What `version`'s restore scores `examples`, their raw ids mapped with its id maps
        (as the request adapter's contract says: unknown ids take row 0)."""
        module, id_maps, config = self.restored(version)
        adapter = self.adapter(config)
        mapped = [dict(e) for e in examples]
        for field, table in dict(getattr(adapter, "id_features", {})).items():
            rows = id_maps[table].lookup([str(e[field]) for e in examples])
            for example, row in zip(mapped, rows.tolist(), strict=True):
                example[field] = row
        with torch.inference_mode():
            out = module(*adapter.inputs(mapped))
        return np.asarray(adapter.scores(out).numpy())


RUNS: dict[str, Callable[..., UserRun]] = {
    "two_tower": UserRun.two_tower,
    "deepfm": UserRun.deepfm,
}
