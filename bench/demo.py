"""`checknrun demo`: the whole pipeline on the embedded default, trainer and server side by side.

The demo trains a DLRM online on MovieLens-1M in this process (the same trainer API
`checknrun train` uses), publishing incremental int4 versions to a `file://` store and a local
announcement log under `--dir`, while `checknrun serve` runs as a separate process on a free
loopback port and follows them, exactly as in production. After each version the console shows
both sides on the same upcoming samples:

    v7 delta 146.8 kB 6.7x < fp32 | served v7 (0.0 s behind) | next 4,096: trainer AUC
    0.7570  served AUC 0.7451

"trainer" is the progressive-validation AUC of the training model on the samples that follow
version v (each scored just before it is trained on); "served" is the AUC the live server gives
the very same samples over REST, scored by the version it serves at that moment. Samples arrive
at `--rate` per second, as in online training (the machine could train faster). The demo ends by
itself after `--max-samples` and shuts the server down; `--max-samples 1000209` runs the whole
stream.
"""

from __future__ import annotations

import argparse
import itertools
import math
import queue
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from bench.child_server import ChildServer, ChildServerError
from bench.demo_options import add_demo_parser
from publisher.cli import CommandError, run_command
from publisher.cli_logging import quiet_library_loggers
from trainer.checkpointer import CheckpointRecord, IncrementalCheckpointer
from trainer.online import build_dlrm, build_optimizers, train_online
from trainer.progressive_metrics import ProgressiveMetrics
from trainer.streams.base import Batch, InteractionStream
from trainer.streams.movielens import load_movielens

MODEL = "movielens"
BATCH_SIZE = 512
_MARKER = ".checknrun-demo"


class _RecordingMetrics(ProgressiveMetrics):
    """Progressive metrics that also keep the trainer's logits of the samples being evaluated."""

    def __init__(self) -> None:
        super().__init__()
        self.capture: list[torch.Tensor] | None = None

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        super().update(logits, labels)
        if self.capture is not None:
            self.capture.append(logits.detach().clone())


@dataclass
class _Window:
    """The samples that follow one version: trainer logits now, server scores later."""

    record: CheckpointRecord
    batches: list[Batch] = field(default_factory=list)
    trainer_logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(b.size for b in self.batches)


def _fresh_workdir(path: Path) -> Path:
    if path.exists():
        if not (path / _MARKER).exists() and any(path.iterdir()):
            raise CommandError(f"--dir {path} exists and is not a demo directory; pick another")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / _MARKER).touch()
    return path


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status."""
    quiet_library_loggers()  # httpx logs each of the demo's requests to the server at INFO
    workdir = _fresh_workdir(Path(args.dir))
    (workdir / "store").mkdir()  # the server waits on an empty store but refuses a missing one
    store_url = f"file://{(workdir / 'store').resolve()}"
    bus_url = f"file://{(workdir / 'announcements.log').resolve()}"
    print(
        f"demo: MovieLens-1M, policy {args.policy}, codec {args.codec}, a version every "
        f"{args.interval_samples:,} samples, {args.max_samples:,} samples; files in {workdir}",
        file=sys.stderr,
    )
    # The server imports torch and waits for the first version: start it first, in parallel.
    with ChildServer(
        store_url,
        MODEL,
        workdir / "server.log",
        bus=bus_url,
        host="127.0.0.1",
        poll_head_after="2",
        bus_start="earliest",
    ) as server:
        _train_and_watch(args, server, store_url, bus_url, workdir)
    return 0


def _train_and_watch(
    args: argparse.Namespace, server: ChildServer, store_url: str, bus_url: str, workdir: Path
) -> None:
    """Train and publish in this process while the monitor scores each version on `server`."""
    torch.set_num_threads(1)  # one core trains, the other serves and encodes
    stream = load_movielens()
    model = build_dlrm(stream.features, stream.dense_names, seed=0, extra={"source": "demo"})
    optimizers = build_optimizers(model)
    metrics = _RecordingMetrics()
    windows: queue.Queue[_Window | None] = queue.Queue()
    monitor = threading.Thread(
        target=_monitor, args=(windows, stream, server.client), name="demo-monitor", daemon=True
    )
    monitor.start()
    started = time.monotonic()
    with IncrementalCheckpointer(
        model,
        optimizers,
        store=store_url,
        model_name=MODEL,
        policy=args.policy,
        codec=args.codec,
        interval_samples=args.interval_samples,
        bus=bus_url,
    ) as ckpt:
        _wait_ready(server)
        hook = _WindowHook(ckpt, metrics, windows, args.eval_samples, args.rate)
        report = train_online(
            model,
            optimizers,
            stream,
            batch_size=BATCH_SIZE,
            stop=min(args.max_samples, stream.num_samples or args.max_samples),
            checkpointer=ckpt,
            metrics=metrics,
            on_batch=hook,
        )
        ckpt.flush()
        last = ckpt.last_version
    windows.put(None)
    monitor.join()
    _wait_for_version(server, last, timeout_s=60)
    _summary(report.summary(), report.metrics, report.seconds, server.client, workdir, started)


class _WindowHook:
    """Paces the stream; after each checkpoint, keeps the trainer's scores of the next samples."""

    def __init__(
        self,
        ckpt: IncrementalCheckpointer,
        metrics: _RecordingMetrics,
        out: queue.Queue[_Window | None],
        size: int,
        rate: float,
    ) -> None:
        self.ckpt, self.metrics, self.out, self.size = ckpt, metrics, out, size
        self.seen_records = 0
        self.window: _Window | None = None
        self.rate = rate
        self.samples = 0
        self.started = time.monotonic()

    def __call__(self, batch: Batch, metrics: ProgressiveMetrics) -> None:
        self.samples += batch.size
        if self.rate > 0:  # wait for the data to "arrive"
            time.sleep(max(0.0, self.started + self.samples / self.rate - time.monotonic()))
        if self.window is not None:
            # `batch` was scored (into metrics.capture) just before it was trained on.
            self.window.batches.append(batch)
            if self.window.samples >= self.size:
                self.metrics.capture = None
                self.out.put(self.window)
                self.window = None
        records = self.ckpt.records
        if len(records) > self.seen_records and self.window is None:
            self.seen_records = len(records)
            self.window = _Window(records[-1])
            self.metrics.capture = self.window.trainer_logits


def _monitor(
    windows: queue.Queue[_Window | None], stream: InteractionStream, client: httpx.Client
) -> None:
    """Score each window on the server and print one line per version."""
    while (window := windows.get()) is not None:
        record = window.record
        deadline = time.monotonic() + 10
        while record.version is None and time.monotonic() < deadline:
            time.sleep(0.05)  # committed in the background, usually within milliseconds
        info = _get(client, "/v1/model") or {}
        served, versions = _served_scores(window, stream, client)
        labels = torch.cat([b.labels for b in window.batches])
        trainer = ProgressiveMetrics()
        trainer.update(torch.cat(window.trainer_logits), labels)
        server = ProgressiveMetrics()
        if served is not None:
            p = served.clamp(1e-7, 1 - 1e-7)
            server.update(torch.log(p / (1 - p)), labels)
        _print_row(record, info, versions, trainer.cumulative(), server.cumulative())


def _served_scores(
    window: _Window, stream: InteractionStream, client: httpx.Client
) -> tuple[torch.Tensor | None, set[int]]:
    scores: list[float] = []
    versions: set[int] = set()
    for batch in window.batches:
        examples = batch_examples(batch, stream)
        answer = _request(client, "POST", "/v1/predict", {"examples": examples})
        if answer is None:
            return None, versions
        scores.extend(answer["scores"])
        versions.add(int(answer["version"]))
    return torch.tensor(scores, dtype=torch.float64), versions


def _wait_ready(server: ChildServer) -> None:
    """Block until the server answers (it becomes ready once the first version exists)."""
    try:
        server.wait_ready(120, path="/healthz")
    except ChildServerError as exc:
        raise CommandError(str(exc)) from exc
    print(f"demo: server up on {server.url}", file=sys.stderr)


def _wait_for_version(server: ChildServer, version: int | None, timeout_s: float) -> None:
    """Give the server time to serve the last version; the summary says what it serves."""
    if version is None:
        return
    try:
        server.wait_version(version, timeout_s)
    except (ChildServerError, httpx.HTTPError, ValueError) as exc:
        print(f"demo: the server has not served v{version}: {exc}", file=sys.stderr)


def _request(
    client: httpx.Client, method: str, path: str, body: Any = None
) -> dict[str, Any] | None:
    """The JSON answer of a 200, None for anything else (the demo shows what it can)."""
    try:
        response = client.request(method, path, json=body)
        if response.status_code != 200:
            return None
        parsed: dict[str, Any] = response.json()
        return parsed
    except (httpx.HTTPError, ValueError):
        return None


def _get(client: httpx.Client, path: str) -> dict[str, Any] | None:
    return _request(client, "GET", path)


def batch_examples(batch: Batch, stream: InteractionStream) -> list[dict[str, Any]]:
    """A batch as the REST API's examples: every feature by name."""
    columns: dict[str, list[Any]] = {}
    dense = batch.dense.numpy()
    for j, name in enumerate(stream.dense_names):
        columns[name] = dense[:, j].astype(float).tolist()
    for feature in stream.features:
        sb = batch.sparse[feature.name]
        values = sb.values.numpy()
        if feature.bag:
            bounds = np.append(sb.offsets.numpy(), len(values)).tolist()
            columns[feature.name] = [values[a:b].tolist() for a, b in itertools.pairwise(bounds)]
        else:
            columns[feature.name] = values[sb.offsets.numpy()].tolist()
    names = list(columns)
    return [dict(zip(names, row, strict=True)) for row in zip(*columns.values(), strict=True)]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _print_row(
    record: CheckpointRecord,
    info: dict[str, Any],
    versions: set[int],
    trainer: dict[str, float],
    server: dict[str, float],
) -> None:
    kind = record.published_kind or record.kind
    size = f"{_fmt_bytes(record.bytes or 0):>9} {record.ratio or 0:5.1f}x < fp32"
    published = (
        f"v{record.version}" if record.version is not None else f"merged->v{record.merged_into}"
    )
    served = "/".join(f"v{v}" for v in sorted(versions)) or "(starting)"
    behind = float(info.get("staleness_s") or 0.0)
    n = int(trainer.get("samples_cumulative", 0))
    t_auc = trainer.get("auc_cumulative", math.nan)
    s_auc = server.get("auc_cumulative", math.nan)
    print(
        f"{published:<5} {kind:<5} {size} | served {served:<5} ({behind:.1f} s behind) | "
        f"next {n:,}: trainer AUC {t_auc:.4f}  served AUC {s_auc:.4f}",
        flush=True,
    )


def _summary(
    summary: dict[str, Any],
    metrics: dict[str, float],
    train_s: float,
    client: httpx.Client,
    workdir: Path,
    started: float,
) -> None:
    info = _get(client, "/v1/model") or {}
    print()
    print(
        f"trained {int(metrics.get('samples_cumulative', 0)):,} samples in {train_s:.0f} s, "
        f"progressive AUC {metrics.get('auc_cumulative', math.nan):.4f}"
    )
    print(
        f"published {summary['versions']} versions: {_fmt_bytes(summary['bytes_written'])} "
        f"written instead of {_fmt_bytes(summary['full_fp32_bytes'])} of full fp32 checkpoints "
        f"({summary['ratio']}x less); training stall per checkpoint: median "
        f"{summary['stall_ms_median']} ms, max {summary['stall_ms_max']} ms"
    )
    if info:
        print(
            f"server: serving v{info.get('version')} ({info.get('versions_applied')} versions "
            f"applied, {_fmt_bytes(float(info.get('bytes_fetched') or 0))} fetched)"
        )
    print(f"demo done in {time.monotonic() - started:.0f} s; files in {workdir}")


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.demo [options]`: the command without the entry point."""
    parser = argparse.ArgumentParser(prog="python -m bench.demo")
    sub = parser.add_subparsers(dest="command", required=True)
    add_demo_parser(sub).set_defaults(func=cmd_demo)
    args = parser.parse_args(["demo", *(argv if argv is not None else sys.argv[1:])])
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
