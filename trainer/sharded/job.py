"""One rank's job: the stream, sharded model and dense optimizer the `train` options describe.

`checknrun train --nproc N` (trainer/cli.py) checks the options, then spawns the ranks
(`run_job`); under torchrun each process enters through `torchrun_rank`. Every rank opens the
same stream and takes its slice of each global batch; rank 0 prints progress and the summary.

Every rank publishes its shards through a ShardedCheckpointer (trainer/sharded/checkpointing.py)
to `--store`; rank 0 holds the job's lease, commits each version and announces it on `--bus`.
`--resume` loads a version written by any number of ranks (or by the one-process trainer) and
continues the file at its reader position.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from publisher.bus import open_announcer
from publisher.cli import (
    REPORTED,
    CommandError,
    CommandParser,
    parse_command_line,
    report_failure,
)
from publisher.read.catalog import Catalog, NoVersionError
from publisher.store import ObjectStore, open_store
from publisher.write.policies import codec_for_expected_restores
from publisher.write.publishing import PublishResult
from schemas.errors import BadDataError
from trainer.cli import (
    DEFAULT_INTERVAL_SAMPLES,
    _human_bytes,
    add_train_args,
    default_embedding_dim,
    default_model_name,
    open_stream,
    resume_version,
    whole_batches,
)
from trainer.online import DLRMSettings, dense_optimizer, dlrm_config
from trainer.sharded.checkpointing import ShardedCheckpointer
from trainer.sharded.collective import TorchCollective
from trainer.sharded.data import check_batch_size
from trainer.sharded.launch import run_rank, spawn_ranks
from trainer.sharded.loop import ShardedReport, train_sharded
from trainer.sharded.model import build_sharded_dlrm, dense_parameters
from trainer.sharded.plan import ROWWISE_ADAGRAD_EPS
from trainer.streams.base import InteractionStream
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
    if args.interval_seconds is not None:
        raise CommandError(
            "--interval-seconds: the ranks of a sharded job (--nproc) must checkpoint at the same "
            "step, and their clocks differ: use --interval-samples"
        )
    if args.on_nonfinite != "stop":
        raise CommandError("--on-nonfinite skip: a sharded job (--nproc) stops on NaN or inf")
    if args.publish_in != "thread":
        raise CommandError("--publish-in process: a sharded job (--nproc) publishes in threads")
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
    backend = "nccl" if args.device == "cuda" else "gloo"  # as under torchrun
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
    model_name = args.model or default_model_name(args.data)
    # --codec auto (the default) is the floor of the measured bit rule: a sharded job does not
    # measure served loss, so it never steps up from it.
    codec = args.codec
    if codec == "auto":
        codec = codec_for_expected_restores(args.expected_restores)
    store = open_store(args.store, create=True)
    checkpointer = ShardedCheckpointer(
        model,
        optimizer,
        store=store,
        model_name=model_name,
        collective=TorchCollective.new(timeout_s=COLLECTIVE_TIMEOUT_S),
        sparse_hyper={"lr": args.sparse_lr, "eps": ROWWISE_ADAGRAD_EPS},
        policy=args.policy,
        codec=codec,
        interval_samples=args.interval_samples or DEFAULT_INTERVAL_SAMPLES,
        model_config=config.to_json(),
        announce=open_announcer(args.bus, model_name).announce if rank == 0 and args.bus else None,
        on_published=_published if rank == 0 and not args.json else None,
    )
    try:
        start, resumed = _resume(checkpointer, stream, args, store, model_name)
    except BaseException:
        checkpointer.close(flush=False)
        raise
    stop = whole_batches(args.max_samples, start, args.batch_size, say=rank == 0)
    if rank == 0 and not args.json:
        print(
            f"{world_size} rank(s), {args.sharding} tables on {device.type}, publishing "
            f"{model_name!r} to {args.store} ({args.policy}, {codec})"
            + (f", resumed from v{resumed} at sample {start:,}" if resumed is not None else ""),
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
        start=start,
        stop=stop,
        checkpointer=checkpointer,
        on_step=_progress if rank == 0 and not args.no_progress and not args.json else None,
    )
    if rank == 0:
        _report(args, world_size, report, model_name, resumed, checkpointer)


#: how long a rank waits for the others in a publishing round before the job stops.
COLLECTIVE_TIMEOUT_S = 120.0


def _resume(
    checkpointer: ShardedCheckpointer,
    stream: InteractionStream,
    args: argparse.Namespace,
    store: ObjectStore,
    model_name: str,
) -> tuple[int, int | None]:
    """(start offset, resumed version) for --resume; (0, None) without it, after refusing to
    start a new history on a model that has versions unless --new-lineage says so."""
    if args.resume is None:
        latest = Catalog(store, model_name).latest()
        if latest is not None and not args.new_lineage:
            raise CommandError(
                f"model {model_name!r} already has versions (v{latest.version}): --resume "
                "continues it, --new-lineage starts a new history on top of it, --model NAME "
                "trains another model"
            )
        return 0, None
    version = resume_version(args.resume)
    try:
        position = checkpointer.resume(version)
        start = stream.resume_offset(position.reader)
    except NoVersionError as exc:
        raise CommandError(f"--resume: {exc}; run without --resume to start fresh") from exc
    except BadDataError as exc:
        raise CommandError(f"--resume: {exc}") from exc
    if version is None:
        latest = Catalog(store, model_name).latest()
        version = None if latest is None else latest.version
    return start, version


def _published(result: PublishResult) -> None:
    manifest = result.manifest
    ranks = manifest.position.ranks
    print(
        f"published v{manifest.version} {manifest.kind:<5} {_human_bytes(result.bytes_written):>9} "
        f"({result.ratio:.1f}x < fp32)  samples {manifest.position.samples_seen:,}  "
        f"{len(ranks) if ranks else 1} rank(s)",
        file=sys.stderr,
    )


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


def _report(
    args: argparse.Namespace,
    world_size: int,
    report: ShardedReport,
    model_name: str,
    resumed: int | None,
    checkpointer: ShardedCheckpointer,
) -> None:
    doc: dict[str, Any] = {
        "model": model_name,
        "store": args.store,
        "resumed_from": resumed,
        "versions": [r.version for r in checkpointer.records if r.version is not None],
        "last_version": checkpointer.last_version,
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
