"""The two user models of examples/ trained online and published, for the tests that follow
them (a `Subscriber`, `checknrun serve --model-factory`, a framework).

    run = UserRun.of("two_tower", store_url, "tt", codec="int4")   # or RUNS["two_tower"](...)
    run.train(steps=10)
    version = run.checkpoint()                      # a committed version
    batch = run.requests(16)                        # examples as a client sends them
    scores = run.restored_scores(version, batch)    # what that version's restore scores

The training is tests/example_training.py's (scored, trained, kept for the served loss,
checkpointed); this module adds what a client sends and what a version's restore answers. The
two-tower model maps raw string ids through id maps (a model of an open id space), the DeepFM
model takes integer ids and dense features.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from examples import deepfm, two_tower
from publisher.id_map import IdMap
from publisher.read import restore
from publisher.read.module_state import load_module_state
from publisher.store import open_store
from tests.example_training import ExampleTrainer
from trainer.checkpointer import IncrementalCheckpointer

#: samples per interval: a version every 10 steps of 64.
INTERVAL = 640
CONFIGS: dict[str, Any] = {
    "two_tower": two_tower.TwoTowerConfig(users=400, items=200, categories=12, dim=8, hidden=16),
    "deepfm": deepfm.DeepFMConfig(users=200, items=120, tags=16, dim=8, dense=3, hidden=16),
}
ADAPTERS: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "two_tower": two_tower.requests,
    "deepfm": deepfm.requests,
}


def _two_tower_requests(config: Any, rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
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


def _deepfm_requests(config: Any, rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
    return [
        {
            "user": int(rng.integers(0, config.users)),
            "item": int(rng.integers(0, config.items)),
            "tags": rng.integers(0, config.tags, int(rng.integers(0, 3))).tolist(),
            "dense": rng.normal(size=config.dense).round(3).tolist(),
        }
        for _ in range(n)
    ]


REQUESTS = {"two_tower": _two_tower_requests, "deepfm": _deepfm_requests}


@dataclass
class UserRun:
    """One user model, trained by an `ExampleTrainer` and published by its checkpointer."""

    name: str
    example: str
    store_url: str
    trainer: ExampleTrainer
    checkpointer: IncrementalCheckpointer
    config: Any
    rng: np.random.Generator

    @classmethod
    def of(
        cls, example: str, store_url: str, name: str, config: Any = None, **checkpointer: Any
    ) -> UserRun:
        """`example`'s model under `name`; `checkpointer` options for `IncrementalCheckpointer`
        (`codec="auto"` measures with the example's `score`)."""
        config = config or CONFIGS[example]
        trainer = ExampleTrainer(example, seed=1, config=config)
        options: dict[str, Any] = {"interval_samples": INTERVAL, **checkpointer}
        if options.get("codec") == "auto":
            options.setdefault("score", trainer.score)
        ckpt = trainer.checkpointer(store_url, name, **options)
        return cls(name, example, store_url, trainer, ckpt, config, np.random.default_rng(7))

    @property
    def model(self) -> nn.Module:
        return self.trainer.model

    @property
    def build(self) -> Callable[[Mapping[str, Any]], nn.Module]:
        return self.trainer.build

    @property
    def adapter(self) -> Callable[[Mapping[str, Any]], Any]:
        return ADAPTERS[self.example]

    # --- training ----------------------------------------------------------------------------

    def train(self, steps: int) -> None:
        """`steps` optimizer steps, checkpointing when an interval is due."""
        self.trainer.train(steps, self.checkpointer)

    def checkpoint(self) -> int:
        """A version of the state now, committed; returns its number."""
        return self.checkpointer.commit_now(reader={"offset": self.checkpointer.samples_seen})

    def close(self) -> None:
        self.checkpointer.close()

    # --- what a version scores ---------------------------------------------------------------

    def requests(self, n: int) -> list[dict[str, Any]]:
        """`n` examples as a client sends them (the request adapter's format)."""
        return REQUESTS[self.example](self.config, self.rng, n)

    def restored(self, version: int) -> tuple[nn.Module, dict[str, IdMap], dict[str, Any]]:
        """The model at `version` rebuilt from its restore: module, id maps, model_config."""
        with open_store(self.store_url, create=False) as store:
            state = restore(store, self.name, version)
        module = self.build(state.manifest.model_config_)
        id_maps = load_module_state(module, state)
        module.eval()
        return module, id_maps, dict(state.manifest.model_config_)

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


def _run_of(example: str) -> Callable[..., UserRun]:
    def make(store_url: str, name: str, config: Any = None, **checkpointer: Any) -> UserRun:
        return UserRun.of(example, store_url, name, config, **checkpointer)

    return make


RUNS: dict[str, Callable[..., UserRun]] = {name: _run_of(name) for name in CONFIGS}
