"""A user's own TorchRec model, unsharded, through `IncrementalCheckpointer`: an
EmbeddingBagCollection and an EmbeddingCollection fed KeyedJaggedTensors, trained by plain torch
optimizers (or torchrec's `apply_optimizer_in_backward`), checkpointed, restored and resumed like
a model of `nn.EmbeddingBag`s."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from bench.sharded_job import Job, run_ranks
from publisher.codecs import encode_rows, max_abs_error_bound
from publisher.read import ModuleSink, Subscriber
from publisher.read.catalog import Catalog
from publisher.read.restore import restore
from publisher.store import FileStore
from schemas.delta_blob import decode_delta_blob, round_to_bfloat16
from schemas.manifest import TableEntry
from tests.unit.trainer.sharded.job import assert_holds_expected, sharded_state
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


# --- the same model sharded by DistributedModelParallel -----------------------------------------

SPARSE_LR, EPS = 0.05, 1e-8
#: the user table split by rows over the ranks, the others held whole by one rank each.
SHARDING = {"user": "row_wise", "item": "table_wise", "history": "table_wise"}
SHARDED_STEPS = 6


def sharded_ranker(world: int) -> Job:
    """`UserRanker` sharded over the default group as a user would: TorchRec's planner with
    one sharding per table, the tables' optimizer fused (EXACT_ROWWISE_ADAGRAD), Adam on the
    rest."""
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
    from torchrec.distributed.types import ShardingEnv

    from trainer.sharded.model import dense_parameters
    from trainer.sharded.plan import embedding_sharder

    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": SPARSE_LR}
    # Row-wise shards on CPU need trainer/sharded/plan.py's sharder for the bags (TorchRec
    # offers them only on GPUs); its EmbeddingCollection sharder offers them as it is.
    sharders = [
        embedding_sharder("cpu", SPARSE_LR),
        EmbeddingCollectionSharder(fused_params={**fused, "eps": EPS}),
    ]
    torch.manual_seed(0)
    module = UserRanker(device=torch.device("meta"))
    planner = EmbeddingShardingPlanner(
        topology=TopologyFactory.create_topology(
            trainer_config=TrainerConfig(world_size=world, local_world_size=world),
            kernel_config=KernelConfig(compute_device="cpu"),
        ),
        constraints={
            name: ParameterConstraints(sharding_types=[kind], compute_kernels=["fused"])
            for name, kind in SHARDING.items()
        },
    )
    group = dist.group.WORLD
    assert group is not None
    model = DistributedModelParallel(
        module,
        env=ShardingEnv.from_process_group(group),
        device=torch.device("cpu"),
        plan=planner.collective_plan(module, sharders, group),
        sharders=sharders,
    )
    return Job(model, torch.optim.Adam(dense_parameters(model), lr=0.01))


def _sharded_train_and_publish(rank: int, world: int, root: str) -> None:
    from trainer.sharded.checkpointing import ShardedCheckpointer
    from trainer.sharded.collective import TorchCollective

    job = sharded_ranker(world)
    with ShardedCheckpointer(
        job.model,
        job.dense_optimizer,
        store=FileStore(Path(root)),
        model_name=MODEL,
        collective=TorchCollective.new(timeout_s=60.0),
        sparse_hyper={"lr": SPARSE_LR, "eps": EPS},
        policy="consecutive",
        codec="fp32",
        interval_samples=2 * world * BATCH,
    ) as ckpt:
        for step in range(SHARDED_STEPS):
            bags, sequence, labels, _ = batch(10 * step + rank)
            loss = nn.functional.binary_cross_entropy_with_logits(job.model(bags, sequence), labels)
            job.dense_optimizer.zero_grad(set_to_none=True)
            loss.backward()  # the fused optimizer steps the tables here
            job.dense_optimizer.step()
            ckpt.step(world * BATCH, BATCH)
            if ckpt.maybe_checkpoint(reader={"offset": (step + 1) * BATCH}) is not None:
                ckpt.flush()  # one version per checkpoint
    assert [r.kind for r in ckpt.records] == ["full", "delta", "delta"]
    np.savez(Path(root) / f"rank{rank}.npz", **sharded_state(job))


def _restore_on_ranks(rank: int, world: int, root: str) -> None:
    from trainer.sharded.restore_shards import restore_sharded

    job = sharded_ranker(world)
    position = restore_sharded(job.model, job.dense_optimizer, FileStore(Path(root)), MODEL)
    assert position.step == SHARDED_STEPS
    assert_holds_expected(job, root)


def _job_state(root: Path, world: int) -> dict[str, np.ndarray]:
    """The ranks' saved states put together: `table/NAME`, `acc/NAME`, `dense/KEY`, `opt/..`."""
    parts: dict[str, dict[int, np.ndarray]] = {}
    state: dict[str, np.ndarray] = {}
    for rank in range(world):
        with np.load(root / f"rank{rank}.npz") as saved:
            for key, value in saved.items():
                if key.startswith(("dense/", "opt/")):
                    state.setdefault(key, value)
                    continue
                name, start, part = key.rsplit("/", 2)
                parts.setdefault(f"{'table' if part == 'w' else 'acc'}/{name}", {})[int(start)] = (
                    value
                )
    for key, shards in parts.items():
        state[key] = np.concatenate([shards[start] for start in sorted(shards)])
    return state


def _rows_held(root: Path, entry: TableEntry) -> np.ndarray:
    """The global row ids a version's table entry holds (a shard's are shard-local)."""
    store = FileStore(root)
    if entry.shards is None:
        assert entry.blob is not None
        return decode_delta_blob(store.get(entry.blob.key)).row_ids
    return np.concatenate(
        [decode_delta_blob(store.get(s.blob.key)).row_ids + s.row_start for s in entry.shards]
    )


def test_a_sharded_user_model_publishes_and_restores_on_one_rank_and_in_one_process_bitwise(
    tmp_path: Path,
) -> None:
    from trainer.rowwise_adagrad import RowWiseAdagrad

    run_ranks(_sharded_train_and_publish, 2, str(tmp_path))
    versions = Catalog(FileStore(tmp_path), MODEL).versions()
    assert [v.manifest.kind for v in versions] == ["full", "delta", "delta"]
    # Named as the unsharded model names them; the row-wise table stored as one shard per rank.
    user = next(t for t in versions[-1].manifest.tables if t.name == USER)
    assert user.shards is not None and [(s.row_start, s.row_end) for s in user.shards] == [
        (0, 25),
        (25, 50),
    ]
    assert sorted(t.name for t in versions[-1].manifest.tables) == sorted(TABLES)
    # Each delta holds exactly the rows either rank's batches asked for in its interval.
    for version, steps in ((versions[1], (2, 3)), (versions[2], (4, 5))):
        asked = [batch(10 * step + rank)[3] for step in steps for rank in range(2)]
        for entry in version.manifest.tables:
            wanted = np.unique(np.concatenate([a[entry.name] for a in asked]))
            np.testing.assert_array_equal(_rows_held(tmp_path, entry), wanted, entry.name)

    # A job of one rank restores it too (every table whole on that rank).
    job = _job_state(tmp_path, 2)
    np.savez(tmp_path / "expected.npz", **job)
    run_ranks(_restore_on_ranks, 1, str(tmp_path))

    # One process, the model unsharded: the tables' optimizer is the row-wise Adagrad the fused
    # one computes, over the tables in the version's order (by name), then Adam on the rest.
    model = UserRanker()
    order = sorted(TABLES)
    tables = RowWiseAdagrad([model.get_parameter(f"{n}.weight") for n in order], lr=SPARSE_LR)
    dense = torch.optim.Adam(model.head.parameters(), lr=0.01)
    with checkpointer(model, [tables, dense], tmp_path) as ckpt:
        position = ckpt.resume()
    assert (position.step, position.samples_seen) == (SHARDED_STEPS, SHARDED_STEPS * 2 * BATCH)
    for name in TABLES:
        weight = model.get_parameter(f"{name}.weight")
        np.testing.assert_array_equal(weight.detach().numpy(), job[f"table/{name}"])
        np.testing.assert_array_equal(tables.state[weight]["sum"].numpy(), job[f"acc/{name}"])
    for key, value in model.head.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), job[f"dense/head.{key}"])
    for i, per in dense.state_dict()["state"].items():
        for k, v in per.items():
            np.testing.assert_array_equal(torch.as_tensor(v).numpy(), job[f"opt/{i}/{k}"])

    # A serving process of the user's follows the job of 2 ranks as it would one process: its
    # module holds the job's tables (row-range shards joined) and dense state, bit for bit.
    sink = ModuleSink(UserRanker())
    with Subscriber(FileStore(tmp_path), MODEL, sink) as sub:
        assert sub.run(max_versions=3, timeout=30)[-1] == versions[-1].version
        with sink.reader() as copy:
            for name in TABLES:
                np.testing.assert_array_equal(copy.values(name).numpy(), job[f"table/{name}"])
            for key, value in copy.dense.items():
                np.testing.assert_array_equal(value.numpy(), job[f"dense/{key}"])
