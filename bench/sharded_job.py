"""A small sharded job for the tests and `checknrun bench shardckpt`: trainer/sharded/model.py's
sharded DLRM (tables table-wise, row-wise or mixed, trained by the fused EXACT_ROWWISE_ADAGRAD),
its dense part by Adam, random batches any world size splits alike; and `run_ranks` /
`exit_codes`, which run a function on N spawned ranks and report how each exited (a test of a
SIGKILLed rank needs the exit codes, which trainer/sharded/launch.py turns into one error).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from publisher.dlrm import DLRMConfig, SparseBatch, SparseFeature

SPARSE_LR = 0.05
#: how long a rank of `run_ranks` waits for its peers in a training collective.
JOB_TIMEOUT_S = 120.0
#: trainer/sharded/plan.py ROWWISE_ADAGRAD_EPS, the fused optimizer's (not imported: importing this
#: fixture must not import TorchRec, which the spawned ranks do).
EPS = 1e-8
CONFIG = DLRMConfig(
    sparse=(SparseFeature("user", 101), SparseFeature("item", 60), SparseFeature("ad", 37)),
    dense=("x0", "x1"),
    embedding_dim=8,
    bottom_mlp=(16,),
    top_mlp=(8,),
)


class RankError(RuntimeError):
    """A rank of a `run_ranks` job exited with a failure (its traceback is on stderr)."""


def run_ranks(fn: Callable[..., None], world: int, *args: Any, timeout_s: float = 600.0) -> None:
    """`fn(rank, world, *args)` on `world` spawned processes of one gloo job; RankError when a
    rank failed."""
    codes = exit_codes(fn, world, *args, timeout_s=timeout_s)
    if any(codes):
        raise RankError(f"ranks exited with {codes}")


def exit_codes(
    fn: Callable[..., None], world: int, *args: Any, timeout_s: float = 600.0
) -> list[int | None]:
    """The exit codes of `fn(rank, world, *args)` on `world` spawned ranks (-9: SIGKILL, None:
    still running after `timeout_s`, then killed). `fn` and `args` must pickle: a module-level
    function. Each rank's process group is torn down after a barrier, so no rank closes its
    gloo connections while a peer still uses them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    ranks = [
        context.Process(target=_rank_main, args=(rank, world, port, fn, args))
        for rank in range(world)
    ]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = []
    for process in ranks:
        process.join(max(0.0, deadline - time.monotonic()))
        codes.append(process.exitcode)
        if process.exitcode is None:
            process.kill()
            process.join()
    return codes


def _rank_main(
    rank: int, world: int, port: int, fn: Callable[..., None], args: tuple[Any, ...]
) -> None:
    # A rank that aborts in C++ prints where its Python threads were: one rank of these tests
    # aborted once, at or after the teardown barrier ("terminate called without an active
    # exception"), in about 50 runs, under the full test suite; never in isolation.
    faulthandler.enable()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # A rank that failed never reaches the barrier: its peers give up after this, not 30 min.
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=JOB_TIMEOUT_S)
    )
    fn(rank, world, *args)
    dist.barrier()
    dist.destroy_process_group()


@dataclass
class Job:
    model: nn.Module
    dense_optimizer: torch.optim.Optimizer


def sharded_job(
    sharding: str | Mapping[str, str], *, seed: int = 0, config: DLRMConfig = CONFIG
) -> Job:
    """trainer/sharded/model.py's sharded DLRM over the default group: `sharding`
    ("row_wise" or "table_wise") for every table, or per table (by feature name); Adam on the
    dense part."""
    from trainer.sharded.model import build_sharded_dlrm, dense_parameters

    model = build_sharded_dlrm(
        config, sharding=sharding, device=torch.device("cpu"), seed=seed, sparse_lr=SPARSE_LR
    )
    return Job(model, torch.optim.Adam(dense_parameters(model), lr=0.01))


def batch(
    seed: int, size: int, config: DLRMConfig = CONFIG
) -> tuple[torch.Tensor, dict[str, SparseBatch], torch.Tensor]:
    """A reproducible random batch: dense features, one id per feature, labels."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(size, len(config.dense), generator=g)
    sparse = {
        f.name: SparseBatch(torch.randint(0, f.rows, (size,), generator=g), torch.arange(size))
        for f in config.sparse
    }
    labels = torch.randint(0, 2, (size,), generator=g).float()
    return dense, sparse, labels


def train_sharded(
    job: Job, seed: int, size: int, *, config: DLRMConfig = CONFIG, part: tuple[int, int] = (0, 1)
) -> None:
    """One step of the sharded job: on batch `seed` of `size` samples, or on part `rank` of
    `world` (`part`) of it, so jobs of any world size can train on the same global batches."""
    from torchrec import KeyedJaggedTensor

    dense, sparse, labels = batch(seed, size, config)
    rank, world = part
    mine = slice(rank * size // world, (rank + 1) * size // world)
    n = mine.stop - mine.start
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=list(sparse),
        values=torch.cat([b.values[mine] for b in sparse.values()]),
        lengths=torch.ones(n * len(sparse), dtype=torch.int32),
    )
    job.dense_optimizer.zero_grad(set_to_none=True)
    logits = job.model(dense[mine], kjt)
    loss = nn.functional.binary_cross_entropy_with_logits(logits, labels[mine])
    torch.autograd.backward(loss)
    job.dense_optimizer.step()
