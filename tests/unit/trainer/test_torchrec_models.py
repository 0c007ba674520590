"""A user's own TorchRec model, unsharded, through `IncrementalCheckpointer`: an
EmbeddingBagCollection and an EmbeddingCollection fed KeyedJaggedTensors, trained by plain torch
optimizers (or torchrec's `apply_optimizer_in_backward`), checkpointed, restored and resumed like
a model of `nn.EmbeddingBag`s. The same model sharded over 2 ranks:
tests/multiprocess/trainer/test_torchrec_models_sharded.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from publisher.codecs import encode_rows, max_abs_error_bound
from publisher.read.catalog import Catalog
from publisher.read.restore import restore
from publisher.store import FileStore
from schemas.delta_blob import decode_delta_blob, round_to_bfloat16
from trainer.checkpointer import IncrementalCheckpointer

torchrec = pytest.importorskip("torchrec")

MODEL = "ranker"
BATCH = 16
#: rows per table; the batches draw ids from a hot prefix of each, so most rows stay clean.
ROWS = {"user": 50, "item": 80, "history": 40}
HOT = {"user": 50, "item": 12, "history": 20}
USER = "bags.embedding_bags.user"
ITEM = "bags.embedding_bags.item"
HISTORY = "sequence.embeddings.history"
TABLES = {USER: "user", ITEM: "item", HISTORY: "history"}


class UserRanker(nn.Module):
    """A user's model: pooled user and item features (the item table serves two features), a
    sequence of watched items, and a dense head."""

    def __init__(self, device: torch.device | None = None) -> None:
        """`device`: the tables' ("meta" for DistributedModelParallel to allocate its shards)."""
        super().__init__()
        self.bags = torchrec.EmbeddingBagCollection(
            tables=[
                torchrec.EmbeddingBagConfig(
                    name="user", embedding_dim=4, num_embeddings=ROWS["user"], feature_names=["u"]
                ),
                torchrec.EmbeddingBagConfig(
                    name="item",
                    embedding_dim=4,
                    num_embeddings=ROWS["item"],
                    feature_names=["item", "seen"],
                ),
            ],
            device=device,
        )
        self.sequence = torchrec.EmbeddingCollection(
            tables=[
                torchrec.EmbeddingConfig(
                    name="history",
                    embedding_dim=4,
                    num_embeddings=ROWS["history"],
                    feature_names=["history"],
                )
            ],
            device=device,
        )
        self.head = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, bags: object, sequence: object) -> torch.Tensor:
        pooled = self.bags(bags).values()
        history = self.sequence(sequence)["history"]
        # The sum of each sample's sequence: segment_reduce over the jagged lengths.
        summed = torch.segment_reduce(
            history.values(), "sum", lengths=history.lengths(), unsafe=True
        )
        out: torch.Tensor = self.head(torch.cat([pooled, summed], dim=1)).squeeze(1)
        return out


Batch = tuple[object, object, torch.Tensor, dict[str, np.ndarray]]


def batch(step: int) -> Batch:
    """Step `step`'s inputs, labels and the ids each table is asked for (on a sharded job: of
    one rank, whose `step` is its own)."""
    g = torch.Generator().manual_seed(step)
    user = torch.randint(0, HOT["user"], (BATCH,), generator=g)
    item = torch.randint(0, HOT["item"], (BATCH,), generator=g)
    seen_lengths = torch.randint(0, 3, (BATCH,), generator=g)
    seen = torch.randint(0, HOT["item"], (int(seen_lengths.sum()),), generator=g)
    history_lengths = torch.randint(1, 4, (BATCH,), generator=g)
    history = torch.randint(0, HOT["history"], (int(history_lengths.sum()),), generator=g)
    ones = torch.ones(BATCH, dtype=torch.int32)
    bags = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["u", "item", "seen"],
        values=torch.cat([user, item, seen]),
        lengths=torch.cat([ones, ones, seen_lengths.int()]),
    )
    sequence = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["history"], values=history, lengths=history_lengths.int()
    )
    labels = (user % 2).float()
    asked = {
        USER: np.unique(user.numpy()),
        ITEM: np.unique(torch.cat([item, seen]).numpy()),
        HISTORY: np.unique(history.numpy()),
    }
    return bags, sequence, labels, asked


def plain_optimizers(model: UserRanker) -> list[torch.optim.Optimizer]:
    """Adagrad on the tables (dense gradients), Adam on the head."""
    tables = [*model.bags.parameters(), *model.sequence.parameters()]
    return [torch.optim.Adagrad(tables, lr=0.1), torch.optim.Adam(model.head.parameters(), lr=0.01)]


def sgd(model: UserRanker) -> list[torch.optim.Optimizer]:
    """One plain SGD over every parameter."""
    return [torch.optim.SGD(model.parameters(), lr=0.1)]


def in_backward(model: UserRanker) -> list[torch.optim.Optimizer]:
    """torchrec's optimizer-in-backward on the tables (it steps each table in `backward`), Adam
    on the head; the checkpointer is given the per-table optimizers torch made."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    tables = [*model.bags.parameters(), *model.sequence.parameters()]
    with pytest.warns(DeprecationWarning, match="This API is deprecated"):
        apply_optimizer_in_backward(torch.optim.Adagrad, tables, {"lr": 0.1})
    fused = [opt for p in tables for opt in p._in_backward_optimizers]  # type: ignore[attr-defined]
    return [*fused, torch.optim.Adam(model.head.parameters(), lr=0.01)]


Optimizers = Callable[[UserRanker], list[torch.optim.Optimizer]]


def make(seed: int, optimizers: Optimizers) -> tuple[UserRanker, list[torch.optim.Optimizer]]:
    torch.manual_seed(seed)
    model = UserRanker()
    return model, optimizers(model)


def train_step(model: UserRanker, opts: list[torch.optim.Optimizer], step: int) -> Batch:
    bags, sequence, labels, asked = batch(step)
    loss = nn.functional.binary_cross_entropy_with_logits(model(bags, sequence), labels)
    for o in opts:
        o.zero_grad(set_to_none=True)
    loss.backward()
    for o in opts:
        o.step()
    return bags, sequence, labels, asked


def checkpointer(
    model: UserRanker, opts: list[torch.optim.Optimizer], root: Path, codec: str = "fp32"
) -> IncrementalCheckpointer:
    return IncrementalCheckpointer(
        model,
        opts,
        store=FileStore(root),
        model_name=MODEL,
        policy="consecutive",
        codec=codec,
        preallocate=False,
    )


def train(
    model: UserRanker,
    opts: list[torch.optim.Optimizer],
    ckpt: IncrementalCheckpointer,
    steps: range,
    every: int = 3,
) -> list[dict[str, np.ndarray]]:
    """Train `steps`, a version every `every` steps; the ids asked of each table per version."""
    asked: list[dict[str, np.ndarray]] = []
    interval: dict[str, list[np.ndarray]] = {name: [] for name in TABLES}
    for step in steps:
        for name, ids in train_step(model, opts, step)[3].items():
            interval[name].append(ids)
        ckpt.step(BATCH)
        if (step + 1) % every == 0:
            ckpt.checkpoint_now(reader={"offset": (step + 1) * BATCH})
            ckpt.flush()
            asked.append({name: np.unique(np.concatenate(v)) for name, v in interval.items()})
            interval = {name: [] for name in TABLES}
    return asked


def test_tables_have_stable_names_and_the_keyword_lookups_are_tracked(tmp_path: Path) -> None:
    # torchrec calls its nn.EmbeddingBag / nn.Embedding modules with keyword arguments
    # (`input=`, `offsets=`, `per_sample_weights=`): the lookup hooks must see those ids.
    model, opts = make(0, plain_optimizers)
    with checkpointer(model, opts, tmp_path) as ckpt:
        assert list(ckpt.tables) == [USER, ITEM, HISTORY]
        assert ckpt.table_rows == {name: ROWS[short] for name, short in TABLES.items()}
        *_, asked = train_step(model, opts, 0)
        for name in TABLES:
            np.testing.assert_array_equal(ckpt.tracked.tracker.peek(name), asked[name])
        with torch.no_grad():  # no gradient: no row can change, nothing is marked
            bags, sequence, *_ = batch(1)
            model(bags, sequence)
        for name in TABLES:
            np.testing.assert_array_equal(ckpt.tracked.tracker.peek(name), asked[name])


def _delta_rows(root: Path) -> list[dict[str, np.ndarray]]:
    """The row ids each delta version of the store holds, per table."""
    store = FileStore(root)
    rows = []
    for ref in Catalog(store, MODEL).versions():
        if ref.manifest.kind != "delta":
            continue
        per_table = {}
        for entry in ref.manifest.tables:
            assert entry.blob is not None
            per_table[entry.name] = decode_delta_blob(store.get(entry.blob.key)).row_ids
        rows.append(per_table)
    return rows


@pytest.mark.parametrize("optimizers", [plain_optimizers, sgd, in_backward])
def test_versions_hold_the_rows_touched_and_restore_and_resume_bitwise(
    tmp_path: Path, optimizers: Optimizers
) -> None:
    model, opts = make(0, optimizers)
    with checkpointer(model, opts, tmp_path) as ckpt:
        asked = train(model, opts, ckpt, range(12))
    versions = Catalog(FileStore(tmp_path), MODEL).versions()
    assert [v.manifest.kind for v in versions] == ["full", "delta", "delta", "delta"]
    assert versions[-1].manifest.model_config_["class"].endswith("UserRanker")
    # Each delta holds exactly the rows its interval's batches asked for, no more, no fewer.
    for held, wanted in zip(_delta_rows(tmp_path), asked[1:], strict=True):
        assert held.keys() == wanted.keys()
        for name in TABLES:
            np.testing.assert_array_equal(held[name], wanted[name])

    state = restore(FileStore(tmp_path), MODEL)
    live = model.state_dict()
    for name in TABLES:
        np.testing.assert_array_equal(state.tables[name].weights, live[f"{name}.weight"].numpy())
    for key, value in state.dense.items():
        np.testing.assert_array_equal(value, live[key].numpy())

    # Resumed into a fresh model, training goes on exactly as if it had never stopped.
    fresh, fresh_opts = make(1, optimizers)
    with checkpointer(fresh, fresh_opts, tmp_path) as resumed:
        position = resumed.resume()
        assert (position.step, position.samples_seen) == (12, 12 * BATCH)
        for step in range(12, 15):
            train_step(fresh, fresh_opts, step)
    for step in range(12, 15):
        train_step(model, opts, step)
    for (key, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
    for o1, o2 in zip(opts, fresh_opts, strict=True):
        s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
        assert s1.keys() == s2.keys()
        for j in s1:
            for k in s1[j]:
                assert torch.equal(torch.as_tensor(s1[j][k]), torch.as_tensor(s2[j][k])), (j, k)


def test_int4_versions_restore_and_resume_within_the_codec_bound(tmp_path: Path) -> None:
    model, opts = make(0, plain_optimizers)
    with checkpointer(model, opts, tmp_path, codec="int4") as ckpt:
        train(model, opts, ckpt, range(9))
    state = restore(FileStore(tmp_path), MODEL)
    fresh, fresh_opts = make(1, plain_optimizers)
    with checkpointer(fresh, fresh_opts, tmp_path, codec="int4") as resumed:
        resumed.resume()
    for name in TABLES:
        weight, resumed_weight = (
            model.get_parameter(f"{name}.weight"),
            fresh.get_parameter(f"{name}.weight"),
        )
        expected = weight.detach().numpy()
        bound = max_abs_error_bound(encode_rows("int4", expected))
        for restored in (state.tables[name].weights, resumed_weight.detach().numpy()):
            assert np.all(np.abs(restored - expected).max(axis=1) <= bound), name
        # A lossy codec's rows carry their Adagrad sums as bfloat16 (publisher/write/publishing.py).
        np.testing.assert_array_equal(
            fresh_opts[0].state[resumed_weight]["sum"].numpy(),
            round_to_bfloat16(opts[0].state[weight]["sum"].numpy()),
        )
    for key, value in model.head.state_dict().items():  # the dense part stays fp32: bitwise
        assert torch.equal(value, fresh.head.state_dict()[key]), key
