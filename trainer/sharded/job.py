"""One rank's job: the stream, sharded model and dense optimizer the `train` options describe.

`checknrun train --nproc N` (trainer/cli.py) checks the options, then spawns the ranks
(`run_job`); under torchrun each process enters through `torchrun_rank`. Every rank opens the
same stream and takes its slice of each global batch; rank 0 prints progress and the summary.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from publisher.cli import (
    REPORTED,
    CommandError,
    CommandParser,
    parse_command_line,
    report_failure,
)
from trainer.cli import add_train_args, default_embedding_dim, open_stream, whole_batches
from trainer.online import DLRMSettings, dense_optimizer, dlrm_config
from trainer.sharded.data import check_batch_size
from trainer.sharded.launch import run_rank, spawn_ranks
from trainer.sharded.loop import ShardedReport, train_sharded
from trainer.sharded.model import build_sharded_dlrm, dense_parameters
from trainer.streams.kafka_events import KafkaEventStream

#: rank 0 prints a progress line every this many steps.
PROGRESS_EVERY_STEPS = 50


def check_job_options(args: argparse.Namespace, world_size: int) -> None:
    """Refuse, before any process starts, the `train` options a sharded job cannot honour."""
    if args.sparse_optimizer != "rowwise-adagrad":
        raise CommandError(
            f"--sparse-optimizer {args.sparse_optimizer}: a sharded job (--nproc) trains its "
            "tables with TorchRec's fused row-wise Adagrad only (rowwise-adagrad)"
        )
    if args.resume is not None:
        raise CommandError("--resume: a sharded job (--nproc) does not restore versions yet")
    if args.data.startswith("kafka://"):
        raise CommandError(
            "a sharded job (--nproc) reads a data file or data set: live topics are not split "
            "over ranks yet"
        )
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        if gpus < world_size:
            raise CommandError(
                f"--device cuda needs a GPU per rank: {world_size} ranks, {gpus} GPUs"
            )
    check_batch_size(args.batch_size, world_size)


def run_job(args: argparse.Namespace) -> int:
    """`checknrun train --nproc N`: the job's N ranks on this host; returns the exit status."""
    check_job_options(args, args.nproc)
    backend = "nccl" if args.device == "cuda" and args.nproc > 1 else "gloo"
    spawn_ranks(functools.partial(train_rank, args), args.nproc, backend=backend)
    return 0


def torchrun_rank(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """This process's rank of a job torchrun started: the `train` options, RANK, WORLD_SIZE,
    LOCAL_RANK (and MASTER_ADDR/MASTER_PORT for the process group) from `environ`."""
    parser = CommandParser(prog="python -m trainer.sharded.launch")
    add_train_args(parser)
    args = parse_command_line(parser, argv)
    try:
        missing = [name for name in ("RANK", "WORLD_SIZE") if name not in environ]
        if missing:
            raise CommandError(f"{', '.join(missing)} not set: start this module with torchrun")
        rank, world_size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        if args.nproc not in (None, world_size):
            raise CommandError(f"--nproc {args.nproc}, but torchrun started {world_size} ranks")
        check_job_options(args, world_size)
        run_rank(
            functools.partial(train_rank, args),
            rank,
            world_size,
            int(environ.get("LOCAL_RANK", rank)),
            backend="nccl" if args.device == "cuda" else "gloo",
        )
    except (*REPORTED, KeyboardInterrupt) as exc:
        return report_failure(parser.prog, exc, as_json=args.json)
    return 0


def train_rank(args: argparse.Namespace, rank: int, world_size: int, local_rank: int) -> None:
    """Train this rank's part of the job (its process group is up)."""
    torch.set_num_threads(args.threads)
    device = _rank_device(args.device, local_rank)
    stream = open_stream(args)
    if isinstance(stream, KafkaEventStream):  # refused by check_job_options
        raise CommandError("a sharded job reads a data file or data set")
    dim = args.embedding_dim or default_embedding_dim(args.data)
    config = dlrm_config(
        stream.features,
        stream.dense_names,
        DLRMSettings(embedding_dim=dim, bottom_mlp=args.bottom_mlp, top_mlp=args.top_mlp),
        extra={"source": stream.source},
    )
    model = build_sharded_dlrm(
        config, sharding=args.sharding, device=device, seed=args.seed, sparse_lr=args.sparse_lr
    )
    optimizer = dense_optimizer(dense_parameters(model), args.dense_optimizer, args.dense_lr)
    stop = whole_batches(args.max_samples, 0, args.batch_size, say=rank == 0)
    if rank == 0 and not args.json:
        print(
            f"{world_size} rank(s), {args.sharding} tables on {device.type}; nothing is "
            "published yet by a sharded job",
            file=sys.stderr,
        )
    report = train_sharded(
        model,
        optimizer,
        stream,
        batch_size=args.batch_size,
        rank=rank,
        world_size=world_size,
        device=device,
        stop=stop,
        on_step=_progress if rank == 0 and not args.no_progress and not args.json else None,
    )
    if rank == 0:
        _report(args, world_size, report)


def _rank_device(device: str, local_rank: int) -> torch.device:
    if device != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _progress(report: ShardedReport) -> None:
    if report.steps % PROGRESS_EVERY_STEPS == 0:
        print(
            f"step {report.steps:,}  samples {report.samples:,}  loss {report.loss:.4f}  "
            f"{report.samples_per_s:,.0f} samples/s",
            file=sys.stderr,
        )


def _report(args: argparse.Namespace, world_size: int, report: ShardedReport) -> None:
    doc: dict[str, Any] = {
        "data": args.data,
        "nproc": world_size,
        "sharding": args.sharding,
        "device": args.device,
        "batch_size": args.batch_size,
        "start_offset": report.start_offset,
        "end_offset": report.end_offset,
        "samples": report.samples,
        "steps": report.steps,
        "seconds": round(report.seconds, 3),
        "samples_per_s": round(report.samples_per_s, 1),
        "rank0_loss": round(report.loss, 6),
    }
    if args.json:
        print(json.dumps(doc))
        return
    print(
        f"trained {report.samples:,} samples on {world_size} rank(s) in {report.seconds:.1f} s "
        f"({report.samples_per_s:,.0f} samples/s), rank 0 loss {report.loss:.4f}"
    )
