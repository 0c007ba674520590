"""The example user models (examples/two_tower.py: plain tables on raw string ids through id
maps; examples/deepfm.py: a TorchRec EmbeddingBagCollection fed a KeyedJaggedTensor) trained
online under an `IncrementalCheckpointer`, as a user's loop would: score, train, keep the
scored batch, count the step, maybe checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from examples import deepfm, two_tower
from publisher.id_map import IdMap
from trainer.checkpointer import IncrementalCheckpointer

EXAMPLES = ("two_tower", "deepfm")
BATCH = 64


class ExampleTrainer:
    """One example model, its optimizers, id maps (two_tower) and click stream."""

    def __init__(self, example: str, *, seed: int = 0, config: Any = None) -> None:
        """`config`: the example's config (default: a small one)."""
        torch.manual_seed(seed)
        self.example = example
        self.id_maps: dict[str, IdMap] = {}
        self.model: nn.Module
        if example == "two_tower":
            config = config or two_tower.TwoTowerConfig(users=400, items=200, categories=12)
            self.model = two_tower.TwoTower(config)
            self.optimizers = two_tower.optimizers(self.model)
            self.id_maps = {"user": IdMap(config.users), "item": IdMap(config.items)}
            assigners = {name: two_tower.RowAssigner(m) for name, m in self.id_maps.items()}
            stream = two_tower.Stream(config, seed=seed, batch=BATCH)

            def next_batch() -> tuple[Any, torch.Tensor]:
                b = stream.next()
                users = assigners["user"].rows(b.users)
                items = assigners["item"].rows(b.items)
                return two_tower.inputs_of(b, users, items), b.labels

            self.score: Callable[[nn.Module, Any], torch.Tensor] = two_tower.score
            self.build: Callable[[Mapping[str, Any]], nn.Module] = two_tower.build
        elif example == "deepfm":
            fm_config = config or deepfm.DeepFMConfig(users=300, items=200, tags=20)
            self.model = deepfm.DeepFM(fm_config)
            self.optimizers = deepfm.optimizers(self.model)
            fm_stream = deepfm.Stream(fm_config, seed=seed, batch=BATCH)

            def next_batch() -> tuple[Any, torch.Tensor]:
                b = fm_stream.next()
                return b.inputs, b.labels

            self.score = deepfm.score
            self.build = deepfm.build
        else:
            raise ValueError(f"unknown example {example!r}")
        self.next_batch = next_batch

    def checkpointer(
        self, store: str, model_name: str | None = None, **options: Any
    ) -> IncrementalCheckpointer:
        """A checkpointer of this model (its id maps given) under `model_name` (default: the
        example's name), `options` passed on."""
        return IncrementalCheckpointer(
            self.model,
            self.optimizers,
            store=store,
            model_name=model_name or self.example,
            id_maps=self.id_maps or None,
            **options,
        )

    def train(self, steps: int, ckpt: IncrementalCheckpointer | None = None) -> None:
        """`steps` batches: scored, trained on, kept for the served loss, checkpointed (each
        checkpoint flushed before the next batch)."""
        for _ in range(steps):
            inputs, labels = self.next_batch()
            logits = self.score(self.model, inputs)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)
            for optimizer in self.optimizers:
                optimizer.step()
            if ckpt is not None:
                ckpt.keep_scored(inputs, labels)
                ckpt.step(len(labels))
                if ckpt.maybe_checkpoint(reader={"offset": ckpt.samples_seen}) is not None:
                    ckpt.flush()  # one version per checkpoint: none folded into the next
