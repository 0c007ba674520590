"""One rank's job: the stream, sharded model and dense optimizer the `train` options describe.

`checknrun train --nproc N` (trainer/cli.py) checks the options, then spawns the ranks
(`run_job`); under torchrun each process enters through `torchrun_rank`. On a file or data set
every rank opens the same stream and takes its slice of each global batch; on a live topic
(`--data kafka://...`, `--id-space hash`) each rank reads its own partitions and the ranks vote
before each step (trainer/sharded/step_votes.py, loop.py). Rank 0 prints progress and the
summary.

Every rank publishes its shards through a ShardedCheckpointer (trainer/sharded/checkpointing.py)
to `--store`; rank 0 holds the job's lease, commits each version and announces it on `--bus`.
`--resume` loads a version written by any number of ranks (or by the one-process trainer) and
continues the file at its reader position, or each partition of the topic at its offset.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from publisher.bus import open_announcer
from publisher.cli import (
    CommandError,
)
from publisher.read.catalog import Catalog, NoVersionError
from publisher.store import ObjectStore, open_store
from publisher.write.publishing import PublishResult
from schemas.errors import BadDataError
from schemas.manifest import Position
from trainer.live_options import open_live_stream
from trainer.online import DLRMSettings, dense_optimizer, dlrm_config
from trainer.options import (
    DEFAULT_COUNT_FEATURES,
    DEFAULT_INTERVAL_SAMPLES,
    check_codec_options,
    default_embedding_dim,
    default_model_name,
    gate_config,
    human_bytes,
    is_live,
    resume_version,
    whole_batches,
)
from trainer.report_text import served_text
from trainer.sharded.checkpointing import ShardedCheckpointer
from trainer.sharded.collective import GlooGroup, TorchCollective
from trainer.sharded.data import check_batch_size
from trainer.sharded.file_steps import FileSteps
from trainer.sharded.loop import ShardedReport, StepSource, train_steps
from trainer.sharded.model import build_sharded_dlrm, dense_parameters
from trainer.sharded.owned_ids import IdOwners, OwnedIds
from trainer.sharded.plan import ROWWISE_ADAGRAD_EPS
from trainer.sharded.step_votes import StepAgreement, rank_partitions
from trainer.sharded.topic_part import RankTopicPart
from trainer.signals import stop_on_signals
from trainer.sources import open_stream
from trainer.streams.base import InteractionStream
from trainer.streams.kafka_events import live_model_extra
from trainer.streams.kafka_reader import EventSource, topic_partitions

#: `--count-features` left at its default (none in a sharded job).
_DEFAULT_COUNTS = ",".join(DEFAULT_COUNT_FEATURES)
#: rank 0 prints a progress line every this many steps.
PROGRESS_EVERY_STEPS = 50


def check_job_options(args: argparse.Namespace, world_size: int) -> None:
    """Refuse, before any process starts, the `train` options a sharded job cannot honour."""
    if args.sparse_optimizer != "rowwise-adagrad":
        raise CommandError(
            f"--sparse-optimizer {args.sparse_optimizer}: a sharded job (--nproc) trains its "
            "tables with TorchRec's fused row-wise Adagrad only (rowwise-adagrad): its "
            "checkpoints capture that optimizer's one accumulator column per row"
        )
    check_codec_options(args)
    if args.publish_in != "thread":
        raise CommandError(
            "--publish-in process: a sharded job (--nproc) publishes in threads: its publishing "
            "rounds are collectives on the rank's process group, which a child process does "
            "not join"
        )
    if (
        is_live(args.data)
        and args.id_space == "hash"
        and args.count_features not in ("", _DEFAULT_COUNTS)
    ):
        raise CommandError(
            f"--count-features {args.count_features}: the prior counts servers read are kept "
            "in id maps, which the hashed tables of a sharded job (--nproc) do not carry: "
            "use --id-space dynamic (the default), or leave out --count-features"
        )
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        if gpus < world_size:
            raise CommandError(
                f"--device cuda needs a GPU per rank: {world_size} ranks, {gpus} GPUs"
            )
    check_batch_size(args.batch_size, world_size)


def train_rank(args: argparse.Namespace, rank: int, world_size: int, local_rank: int) -> None:
    """Train this rank's part of the job (its process group is up). SIGTERM or Ctrl-C, from
    its first moment, asks the job to stop: the ranks agree at the next step's vote, publish a
    final version and end with exit status 0, on a file as on a topic."""
    stop_event = threading.Event()
    with stop_on_signals(stop_event):
        _train_rank(args, rank, world_size, local_rank, stop_event)


def _train_rank(
    args: argparse.Namespace,
    rank: int,
    world_size: int,
    local_rank: int,
    stop_event: threading.Event,
) -> None:
    torch.set_num_threads(args.threads)
    device = _rank_device(args.device, local_rank)
    topic: _TopicSplit | None = None
    if is_live(args.data):
        topic = _TopicSplit.open(args, rank, world_size, stop_event)
        stream: InteractionStream = topic.part.stream
        extra = live_model_extra(topic.part.stream.spec)
    else:
        stream = open_stream(args)
        extra = {"source": stream.source}
    dim = args.embedding_dim or default_embedding_dim(args.data)
    config = dlrm_config(
        stream.features,
        stream.dense_names,
        DLRMSettings(embedding_dim=dim, bottom_mlp=args.bottom_mlp, top_mlp=args.top_mlp),
        extra=extra,
    )
    model = build_sharded_dlrm(
        config, sharding=args.sharding, device=device, seed=args.seed, sparse_lr=args.sparse_lr
    )
    optimizer = dense_optimizer(dense_parameters(model), args.dense_optimizer, args.dense_lr)
    model_name = args.model or default_model_name(args.data)
    interval_samples = args.interval_samples
    if interval_samples is None and args.interval_seconds is None:
        interval_samples = DEFAULT_INTERVAL_SAMPLES
    store = open_store(args.store, create=True)
    checkpointer = ShardedCheckpointer(
        model,
        optimizer,
        store=store,
        model_name=model_name,
        collective=TorchCollective.new(timeout_s=COLLECTIVE_TIMEOUT_S),
        sparse_hyper={"lr": args.sparse_lr, "eps": ROWWISE_ADAGRAD_EPS},
        policy=args.policy,
        codec=args.codec,
        served_loss_samples=args.served_loss_samples,
        served_loss_budget=args.served_loss_budget if args.codec == "auto" else None,
        served_loss_judge=args.served_loss_judge,
        expected_restores=args.expected_restores if args.codec == "auto" else None,
        interval_samples=interval_samples,
        interval_seconds=args.interval_seconds,
        model_config=config.to_json(),
        announce=open_announcer(args.bus, model_name).announce if rank == 0 and args.bus else None,
        on_published=_published if rank == 0 and not args.json else None,
        on_non_finite=args.on_nonfinite,
        gate=gate_config(args),
    )
    source: StepSource
    try:
        agreement = StepAgreement.new(COLLECTIVE_TIMEOUT_S)
        if topic is not None and args.id_space == "dynamic":
            # every rank, in the same order as its other groups
            group = GlooGroup.new(COLLECTIVE_TIMEOUT_S)
            owners = IdOwners.gather(checkpointer.tables, group)
            checkpointer.attach_ids(OwnedIds.for_stream(topic.part.stream, owners, group))
        if topic is None:
            start, resumed = _resume(
                checkpointer, args, store, model_name, lambda p: stream.resume_offset(p.reader)
            )
            stop = whole_batches(args.max_samples, start, args.batch_size, say=rank == 0)
            features = [f.name for f in config.sparse]
            source = FileSteps(
                stream, args.batch_size, rank, world_size, features, start=start, stop=stop
            )
            max_samples, stop_at_end = None, True
        else:
            start, resumed = _resume(checkpointer, args, store, model_name, topic.resume)
            if rank == 0 and resumed is not None:
                topic.part.stream.restore_metrics(
                    Catalog(store, model_name).find(resumed).manifest.metrics
                )
            max_samples = topic.samples_left(args.max_samples, checkpointer.clock.samples_seen)
            stop_at_end = args.stop_at_end
            topic.part.open(args.batch_size // world_size)
            source = topic.part
    except BaseException:
        checkpointer.close(flush=False)
        if topic is not None:
            topic.part.close()
        raise
    if rank == 0 and not args.json:
        print(
            f"{world_size} rank(s), {args.sharding} tables on {device.type}, publishing "
            f"{model_name!r} to {args.store} ({args.policy}, {args.codec})"
            + (f", resumed from v{resumed} at sample {start:,}" if resumed is not None else ""),
            file=sys.stderr,
        )
    on_step = _progress if rank == 0 and not args.no_progress and not args.json else None
    try:
        report = train_steps(
            model,
            optimizer,
            source,
            agreement,
            device=device,
            stop_at_end=stop_at_end,
            stop_event=stop_event,
            max_samples=max_samples,
            checkpointer=checkpointer,
            on_step=on_step,
        )
        live: dict[str, Any] = {}
        if topic is not None:
            counters = agreement.sum_counters(topic.part.metrics())
            live = {"samples_seen": checkpointer.clock.samples_seen, "stream": counters}
    finally:
        checkpointer.close()
        if topic is not None:
            topic.part.close()
    if rank == 0:
        _report(args, world_size, report, model_name, resumed, checkpointer, live)


class _TopicSplit:
    """A rank's part of a live topic in a sharded job (trainer/sharded/step_votes.py)."""

    def __init__(
        self,
        part: RankTopicPart,
        partitions: tuple[int, ...],
        rank: int,
        world_size: int,
    ) -> None:
        self.part = part
        #: the partitions the job reads, sorted.
        self.partitions = partitions
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def open(
        cls, args: argparse.Namespace, rank: int, world_size: int, stop_event: threading.Event
    ) -> _TopicSplit:
        """Ask the broker for the job's partitions and take this rank's."""
        partitions = topic_partitions(EventSource.parse(args.data))
        mine = rank_partitions(partitions, rank, world_size)
        if args.id_space == "hash":
            # no count features (check_job_options): they need the id maps' counts
            args = argparse.Namespace(**{**vars(args), "count_features": ""})
        stream = open_live_stream(args, stop_event, partitions=mine)
        return cls(RankTopicPart(stream, mine), partitions, rank, world_size)

    def resume(self, position: Position) -> int:
        """Continue at a version's reader (rank 0 carries the partitions no rank reads)."""
        self.part.resume(position.reader, self.partitions, carry=self.rank == 0)
        return 0

    @staticmethod
    def samples_left(max_samples: int | None, samples_seen: int) -> int | None:
        """What --max-samples leaves this run (it counts the model's samples in all)."""
        if max_samples is None:
            return None
        if max_samples <= samples_seen:
            raise CommandError(
                f"nothing to train: the model has trained {samples_seen:,} samples and "
                f"--max-samples is {max_samples:,}"
            )
        return max_samples - samples_seen


#: how long a rank waits for the others in a publishing round before the job stops.
COLLECTIVE_TIMEOUT_S = 120.0


def _resume(
    checkpointer: ShardedCheckpointer,
    args: argparse.Namespace,
    store: ObjectStore,
    model_name: str,
    continue_at: Callable[[Position], int],
) -> tuple[int, int | None]:
    """(start offset, resumed version) for --resume, the stream moved to the version's position
    by `continue_at`; (0, None) without it, after refusing to start a new history on a model
    that has versions unless --new-lineage says so."""
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
        start = continue_at(checkpointer.resume(version))
    except NoVersionError as exc:
        raise CommandError(f"--resume: {exc}; run without --resume to start fresh") from exc
    except BadDataError as exc:
        raise CommandError(f"--resume: {exc}") from exc
    return start, checkpointer.resumed_from


def _published(result: PublishResult) -> None:
    manifest = result.manifest
    ranks = manifest.position.ranks
    print(
        f"published v{manifest.version} {manifest.kind:<5} {human_bytes(result.bytes_written):>9} "
        f"({result.ratio:.1f}x < fp32)  samples {manifest.position.samples_seen:,}  "
        f"{len(ranks) if ranks else 1} rank(s)"
        + served_text(
            manifest.tables[0].codec if manifest.tables else None,
            manifest.served_loss,
            result.reencoded,
        )
        + ("" if result.gate is None else f"  | {result.gate.text()}"),
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
    live: Mapping[str, Any],
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
        "stopped": report.stopped,
        "non_finite_skipped": checkpointer.non_finite_skipped,
        # rank 0's records: its stall per checkpoint, and what each version wrote (cli.py's
        # one-process report has the same list)
        "checkpoints": [r.to_json() for r in checkpointer.records],
        **live,
    }
    if args.json:
        print(json.dumps(doc))
        return
    print(
        f"trained {report.samples:,} samples on {world_size} rank(s) in {report.seconds:.1f} s "
        f"({report.samples_per_s:,.0f} samples/s), rank 0 loss {report.loss:.4f}"
    )
