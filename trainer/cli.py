"""`checknrun train`'s driver: one process, or (`--nproc N`) the N ranks of a sharded job.

The options are trainer/options.py's (the N-rank driver, trainer/sharded/launch.py and job.py,
reads the same); progress goes to stderr; with `--json` one JSON document goes to stdout at the
end and nothing else does. `--resume` continues from the latest (or the given) committed version
at its reader position; a model that already has versions is refused without it or
`--new-lineage` (start a new history from scratch on top of the old one), so a rerun or another
data file under the same `--model` never silently starts over. `--bus URL` announces each
committed version (`file:///PATH` log or `kafka://HOST:PORT/TOPIC`); without it nothing is
announced and subscribers poll HEAD. A live topic runs until SIGTERM / Ctrl-C or
`--max-samples`, and `--resume` continues exactly after the last trained event.

`--nproc N` trains one model over N processes on this host instead (trainer/sharded/: the
tables sharded by TorchRec, `--sharding table_wise|row_wise`, `--device cpu|cuda`; the same job
runs under `torchrun --nproc-per-node N -m trainer.sharded.launch ...`; a live topic is split
by partitions over the ranks, trainer/sharded/step_votes.py).

Registered through the `checknrun.commands` entry point `train = "trainer.command:register"`;
`python -m trainer.cli train ...` runs it without the entry point.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from publisher.bus import BusError
from publisher.cli import CommandError, CommandParser, parse_command_line, run_command
from publisher.cli_logging import configure_logging, quiet_library_loggers
from publisher.dlrm import DLRM
from publisher.read.catalog import Catalog, NoVersionError
from publisher.write.snapshot import NonFiniteSnapshotError
from schemas.errors import BadDataError
from trainer.checkpointer import CheckpointRecord, IncrementalCheckpointer
from trainer.online import (
    DLRMSettings,
    OptimizerSettings,
    TrainingReport,
    build_dlrm,
    build_optimizers,
    train_online,
)
from trainer.options import (
    DEFAULT_INTERVAL_SAMPLES,
    add_train_args,
    check_codec_options,
    default_embedding_dim,
    default_model_name,
    gate_config,
    human_bytes,
    resume_version,
    whole_batches,
)
from trainer.progress import TrainingProgress
from trainer.progressive_metrics import ProgressiveMetrics
from trainer.report_text import served_text, summary_lines
from trainer.signals import stop_on_signals
from trainer.sources import open_stream
from trainer.streams.base import InteractionStream
from trainer.streams.kafka_events import KafkaEventStream, live_model_extra


def build_model(
    args: argparse.Namespace, stream: InteractionStream, *, extra: dict[str, Any] | None = None
) -> tuple[DLRM, list[torch.optim.Optimizer]]:
    """The DLRM and its [sparse, dense] optimizers that the `train` options describe."""
    dim = args.embedding_dim or default_embedding_dim(args.data)
    model = build_dlrm(
        stream.features,
        stream.dense_names,
        DLRMSettings(embedding_dim=dim, bottom_mlp=args.bottom_mlp, top_mlp=args.top_mlp),
        seed=args.seed,
        extra=extra,
    )
    optimizers = build_optimizers(
        model,
        OptimizerSettings(
            sparse=args.sparse_optimizer,
            sparse_lr=args.sparse_lr,
            dense=args.dense_optimizer,
            dense_lr=args.dense_lr,
        ),
    )
    return model, optimizers


def cmd_train(args: argparse.Namespace) -> int:
    """Run `train`; returns the exit status."""
    if args.nproc is not None:
        from trainer.sharded.launch import run_job  # TorchRec loads only for a sharded job

        return run_job(args)
    quiet_library_loggers()  # under `checknrun`, publisher/cli.py configured the root logger
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    torch.set_num_threads(args.threads)
    auto = args.codec == "auto"
    check_codec_options(args)  # before the stream opens
    model_name = args.model or default_model_name(args.data)
    interval_samples = args.interval_samples
    if interval_samples is None and args.interval_seconds is None:
        interval_samples = DEFAULT_INTERVAL_SAMPLES
    stop_event = threading.Event()
    stream = open_stream(args, stop_event)
    live = stream if isinstance(stream, KafkaEventStream) else None
    extra = live_model_extra(live.spec) if live is not None else {"source": stream.source}
    model, optimizers = build_model(args, stream, extra=extra)
    show = not args.no_progress
    # tqdm draws nothing without a terminal: there, TrainingProgress writes lines instead.
    on_terminal = sys.stderr.isatty()
    bar: tqdm[Any] | None = None

    def published(record: CheckpointRecord) -> None:
        if not show or args.json:
            return
        text = _published_line(record)
        if bar is not None:
            bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr)

    try:
        ckpt = IncrementalCheckpointer(
            model,
            optimizers,
            store=args.store,
            model_name=model_name,
            policy=args.policy,
            codec=args.codec,
            # --codec auto: the checkpointer builds the rule (publisher/write/policies.py).
            expected_restores=args.expected_restores if auto else None,
            served_loss_budget=args.served_loss_budget if auto else None,
            served_loss_judge=args.served_loss_judge,
            served_loss_samples=args.served_loss_samples,
            interval_samples=interval_samples,
            interval_seconds=args.interval_seconds,
            bus=args.bus,
            on_published=published,
            publish_in=args.publish_in,
            on_non_finite=args.on_nonfinite,
            id_maps=live.id_maps if live is not None else None,
            gate=gate_config(args),
        )
    except BusError as exc:
        raise CommandError(f"--bus {args.bus}: {exc}") from exc
    with ckpt:
        if live is not None:
            live.attach(ckpt.tables, ckpt.optimizers, ckpt.tracked.tracker)
        start, resumed = _resume(ckpt, stream, args)
        if live is not None:
            # A live stream's samples count from 0 in each run; --max-samples counts them all.
            stop = None if args.max_samples is None else args.max_samples - ckpt.samples_seen
            if stop is not None and stop <= 0:
                raise CommandError(
                    f"nothing to train: the model has trained {ckpt.samples_seen:,} samples "
                    f"and --max-samples is {args.max_samples:,}"
                )
        else:
            stop = whole_batches(args.max_samples, start, args.batch_size)
        if stream.num_samples is not None:
            stop = min(stop or stream.num_samples, stream.num_samples)
        if stop is not None and start >= stop:
            raise CommandError(
                f"nothing to train: the reader is at sample {start:,} and the run stops at "
                f"{stop:,} (raise --max-samples)"
            )
        if live is not None:
            live.open(args.batch_size)  # start-up (and a bad topic) before the clock starts
        if show and on_terminal:
            bar = tqdm(
                total=None if stop is None else stop - start,
                unit="sample",
                unit_scale=True,
                file=sys.stderr,
                desc=model_name,
                dynamic_ncols=True,
            )
        progress = TrainingProgress(model_name, ckpt, live, bar=bar)
        try:
            with contextlib.nullcontext() if bar is None else bar, stop_on_signals(stop_event):
                report = train_online(
                    model,
                    optimizers,
                    stream,
                    batch_size=args.batch_size,
                    start=start,
                    stop=stop,
                    checkpointer=ckpt,
                    metrics=ProgressiveMetrics(),
                    on_batch=progress.on_batch if show else None,
                    on_wait=progress.on_wait if show else None,
                    stop_event=stop_event,
                )
            ckpt.flush()
        except NonFiniteSnapshotError as exc:
            raise NonFiniteSnapshotError(
                f"{exc}; training stopped (--on-nonfinite skip trains on and publishes once the "
                "values are finite again)"
            ) from exc
        finally:
            if live is not None:
                live.close()
    doc = _report_json(args, model_name, resumed, report, ckpt.non_finite_skipped)
    if live is not None:
        doc["samples_seen"] = ckpt.samples_seen
        doc["stream"] = live.metrics()
        doc["reader_cpu_seconds"] = round(live.reader_cpu_s, 3)
    if args.json:
        print(json.dumps(doc))
    else:
        print("\n".join(summary_lines(doc)))
    return 0


def _resume(
    ckpt: IncrementalCheckpointer, stream: InteractionStream, args: argparse.Namespace
) -> tuple[int, int | None]:
    """(start offset, resumed version) for --resume; (0, None) without it."""
    if args.resume is None:
        _check_new_history(ckpt, stream, args.new_lineage)
        return 0, None
    version = resume_version(args.resume)
    try:
        position = ckpt.resume(version, progress=not args.no_progress and not args.json)
        start = stream.resume_offset(position.reader)
    except NoVersionError as exc:
        raise CommandError(f"--resume: {exc}; run without --resume to start fresh") from exc
    except BadDataError as exc:
        raise CommandError(f"--resume: {exc}") from exc
    resumed = ckpt.last_restored_version
    if isinstance(stream, KafkaEventStream) and resumed is not None:
        stream.restore_metrics(Catalog(ckpt.store, ckpt.model_name).find(resumed).manifest.metrics)
    return start, resumed


def _check_new_history(
    ckpt: IncrementalCheckpointer, stream: InteractionStream, new_lineage: bool
) -> None:
    """Refuse to start a new history on a model that has one, unless `--new-lineage` says so.

    Run after the checkpointer took the model's lease, so no other trainer commits meanwhile.
    """
    latest = Catalog(ckpt.store, ckpt.model_name).latest()
    if latest is None or new_lineage:
        return
    name, version = ckpt.model_name, latest.version
    reader = latest.manifest.position.reader
    this = stream.reader_state(0)
    if (reader.get("source"), reader.get("fingerprint")) == (this["source"], this["fingerprint"]):
        raise CommandError(
            f"model {name!r} already has versions (v{version}, trained on "
            f"{latest.manifest.position.samples_seen:,} samples): --resume continues it, "
            "--new-lineage starts a new "
            "history from scratch on top of it, --model NAME trains another model"
        )
    raise CommandError(
        f"model {name!r} (v{version}) was trained on other data (source={reader.get('source')!r} "
        f"fingerprint={reader.get('fingerprint')!r}; this run: source={this['source']!r} "
        f"fingerprint={this['fingerprint']!r}): --model NAME trains a new model, --new-lineage "
        "starts a new history on this one"
    )


def _published_line(record: CheckpointRecord) -> str:
    auc = record.metrics.get("auc")
    return (
        f"published v{record.version} {record.published_kind or record.kind:<5} "
        f"{human_bytes(record.bytes or 0):>9} ({record.ratio or 0:.1f}x < fp32)  "
        f"stall {record.stall_ms:.1f} ms  dirty rows {record.dirty_fraction_total:.2%}  "
        f"samples {record.samples_seen:,}" + (f"  auc {auc:.4f}" if auc is not None else "")
    ) + _served_text(record)


def _served_text(record: CheckpointRecord) -> str:
    gate = "" if record.gate is None else f"  | {record.gate.text()}"
    return served_text(record.codec, record.served_loss, record.reencoded) + gate


def _report_json(
    args: argparse.Namespace,
    model_name: str,
    resumed: int | None,
    report: TrainingReport,
    non_finite_skipped: int,
) -> dict[str, Any]:
    return {
        "model": model_name,
        "store": args.store,
        "data": args.data,
        "policy": args.policy,
        "codec": args.codec,
        "resumed_from": resumed,
        "start_offset": report.start_offset,
        "end_offset": report.end_offset,
        "samples": report.samples,
        "steps": report.steps,
        "seconds": round(report.seconds, 3),
        "cpu_seconds": round(report.cpu_seconds, 3),
        "samples_per_s": round(report.samples_per_s, 1),
        "stopped": report.stopped,
        "metrics": {k: round(v, 6) for k, v in report.metrics.items()},
        "summary": {**report.summary(), "non_finite_skipped": non_finite_skipped},
        "checkpoints": [r.to_json() for r in report.records],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m trainer.cli train ...`: the command without the entry point installed."""
    parser: argparse.ArgumentParser = CommandParser(prog="python -m trainer.cli")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser("train", help="train online and publish incremental checkpoints")
    add_train_args(train)
    train.set_defaults(func=cmd_train)
    args = parse_command_line(parser, argv)
    configure_logging()
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
