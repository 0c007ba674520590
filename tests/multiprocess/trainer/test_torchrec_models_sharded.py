"""A user's own TorchRec model (tests/unit/trainer/test_torchrec_models.py's `UserRanker`)
sharded by DistributedModelParallel over 2 spawned ranks: published, restored on one rank and in
one unsharded process, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from torch import nn

from bench.sharded_job import Job, run_ranks
from publisher.read import ModuleSink, Subscriber
from publisher.read.catalog import Catalog
from publisher.store import FileStore
from schemas.delta_blob import decode_delta_blob
from schemas.manifest import TableEntry
from tests.unit.trainer.sharded.job import assert_holds_expected, sharded_state
from tests.unit.trainer.test_torchrec_models import (
    BATCH,
    MODEL,
    TABLES,
    USER,
    UserRanker,
    batch,
    checkpointer,
)

pytest.importorskip("torchrec")

if TYPE_CHECKING:
    from trainer.sharded.checkpointing import ShardedCheckpointer as ShardedCheckpointerType

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


def _checkpointer(job: Job, root: str, **options: object) -> ShardedCheckpointerType:
    """The tests' ShardedCheckpointer of `job` (the ranks' collective, the fused optimizer's
    hyper-parameters) with `options`."""
    from trainer.sharded.checkpointing import ShardedCheckpointer
    from trainer.sharded.collective import TorchCollective

    return ShardedCheckpointer(
        job.model,
        job.dense_optimizer,
        store=FileStore(Path(root)),
        model_name=MODEL,
        collective=TorchCollective.new(timeout_s=60.0),
        sparse_hyper={"lr": SPARSE_LR, "eps": EPS},
        **options,  # type: ignore[arg-type]
    )


def _train(job: Job, ckpt: ShardedCheckpointerType, rank: int, world: int) -> None:
    """SHARDED_STEPS steps of this rank's batches, each scored, kept (for a served loss) and
    trained on; one version per checkpoint."""
    for step in range(SHARDED_STEPS):
        bags, sequence, labels, _ = batch(10 * step + rank)
        logits = job.model(bags, sequence)
        ckpt.keep_scored((bags, sequence), labels)  # scored before it trains the model
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
        job.dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()  # the fused optimizer steps the tables here
        job.dense_optimizer.step()
        ckpt.step(world * BATCH, BATCH)
        if ckpt.maybe_checkpoint(reader={"offset": (step + 1) * BATCH}) is not None:
            ckpt.flush()  # one version per checkpoint


def _sharded_train_and_publish(rank: int, world: int, root: str) -> None:
    job = sharded_ranker(world)
    options = {"policy": "consecutive", "codec": "fp32", "interval_samples": 2 * world * BATCH}
    with _checkpointer(job, root, **options) as ckpt:
        _train(job, ckpt, rank, world)
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


def _score(module: nn.Module, inputs: tuple[object, object]) -> torch.Tensor:
    out: torch.Tensor = module(*inputs)
    return out


def _unsharded(config: object) -> UserRanker:
    return UserRanker()


def _head_only(config: object) -> nn.Module:
    return UserRanker().head


def _sharded_auto(rank: int, world: int, root: str) -> None:
    job = sharded_ranker(world)
    with _checkpointer(
        job,
        root,
        policy="consecutive",
        codec="auto",
        served_loss_samples=4 * BATCH,
        interval_samples=2 * world * BATCH,
        score=_score,
        model_factory=_unsharded,
    ) as ckpt:
        _train(job, ckpt, rank, world)


def test_a_sharded_user_models_served_loss_is_measured_by_rank_0_and_picks_the_codec(
    tmp_path: Path,
) -> None:
    run_ranks(_sharded_auto, 2, str(tmp_path))
    versions = Catalog(FileStore(tmp_path), MODEL).versions()
    assert [v.manifest.kind for v in versions] == ["full", "delta", "delta"]
    for version in versions[1:]:  # a full's loss needs a served copy that held every row
        loss = version.manifest.served_loss
        # scored on rank 0's samples of the interval (2 steps), on every rank's rows
        assert loss is not None and loss.samples == 2 * BATCH, version.version
        assert 0.0 < loss.auc_fp32 <= 1.0 and loss.logloss_served > 0.0


def _refused(rank: int, world: int, root: str, kwargs: dict[str, object]) -> None:
    from trainer.errors import CheckpointError

    job = sharded_ranker(world)
    with pytest.raises(CheckpointError, match=str(kwargs.pop("match"))):
        _checkpointer(job, root, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"codec": "auto", "match": "needs score="},
        {"codec": "auto", "score": _score, "match": "both score= and model_factory="},
        {
            "served_loss_samples": 8,
            "score": _score,
            "model_factory": _head_only,
            "match": "model_factory built tables",
        },
    ],
    ids=["nothing-to-score-with", "no-factory", "not-the-architecture"],
)
def test_what_a_sharded_job_cannot_measure_is_refused_on_every_rank(
    tmp_path: Path, kwargs: dict[str, object]
) -> None:
    run_ranks(_refused, 2, str(tmp_path), kwargs)
