"""Part `serving`: the serving side in detail: apply time, predict pauses, loopback load, freshness.

    checknrun bench serving apply      # apply time vs delta size, memory, per scheme
    checknrun bench serving pause      # worst predict pause while deltas apply (in-process)
    checknrun bench serving http       # predict latency over HTTP, idle vs applying
    checknrun bench serving freshness  # train step -> served, p50/p99 (file or Kafka+MinIO)
    checknrun bench serving quantized  # fp32 vs int8 vs int4 tables: memory, apply, HTTP p99

Every run is bounded in count and time (`--duration`, `--versions`, `--max-seconds`) and prints
a human summary (`--json OUT` writes the document). A synthetic trainer
(bench/synthetic_run.py) publishes real versions through the real publisher; servers run as
`checknrun serve` child processes on loopback ports (bench/child_server.py). S3 and Kafka URLs
take their settings from the environment (CHECKNRUN_S3_*), as the server does.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from bench.child_server import ChildServer, free_port
from bench.cli import add_run_options
from bench.machine import describe_machine
from bench.predict_load import LoadProcess, percentiles
from bench.synthetic_run import SyntheticRun, random_examples
from publisher.bus import open_announcer, open_source
from publisher.bus.base import AnnouncementSource
from publisher.dlrm import TABLE_PREFIX, DLRMConfig, SparseFeature
from publisher.read.catalog import Catalog
from publisher.read.live_model import LiveModel
from publisher.read.sinks import dlrm_sink
from publisher.store import ObjectStore, open_store
from schemas.announcement import Announcement
from server.feature_batch import build_batch
from trainer.streams.synthetic import N_DENSE, criteo_like_cardinalities

MODEL = "bench"
#: a server imports torch and builds a model of up to 1M rows before it is ready.
SERVER_START_S = 300.0


# --- small utilities ------------------------------------------------------------------------------


def rss_bytes(pid: int | str = "self") -> dict[str, int]:
    """Resident and peak resident memory of a process (Linux /proc)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                name, value, _unit = line.split()
                out[name.rstrip(":")] = int(value) * 1024
    return out


def mib(n: float) -> float:
    return round(n / 2**20, 1)


def bench_config(rows: int, dim: int, small_rows: int = 10_000) -> DLRMConfig:
    """One big table (`item`, `rows` rows), a small one (`user`), a bag, and 4 dense features."""
    return DLRMConfig(
        sparse=(
            SparseFeature("item", rows),
            SparseFeature("user", small_rows),
            SparseFeature("tags", 64, bag=True),
        ),
        dense=("d0", "d1", "d2", "d3"),
        embedding_dim=dim,
        bottom_mlp=(64,),
        top_mlp=(64, 32),
    )


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Abort the whole run (SIGALRM) if it exceeds `seconds`: the bench is always bounded."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"serving bench exceeded --max-seconds={seconds}")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def start_server(
    store: str,
    bus: str | None,
    *,
    scheme: str,
    log_dir: Path,
    torch_threads: int | None = None,
    quantized_tables: bool | None = None,
) -> ChildServer:
    """A `checknrun serve` child with the bench's limits (large batches and bodies)."""
    port = free_port()
    return ChildServer(
        store,
        MODEL,
        log_dir / f"server-{port}.log",
        port=port,
        bus=bus or None,
        consistency=scheme,
        log_level="warning",
        max_batch="4096",
        max_body_bytes=str(16 * 2**20),
        poll_head_after="5",
        torch_threads=None if torch_threads is None else str(torch_threads),
        quantized_tables=None if quantized_tables is None else "on" if quantized_tables else "off",
    )


def prepare_run(store: ObjectStore, args: argparse.Namespace, announce: Any = None) -> SyntheticRun:
    run = SyntheticRun(
        store,
        MODEL,
        bench_config(args.rows, args.dim),
        codec=args.codec,
        announce=announce,
        seed=args.seed,
    )
    started = time.perf_counter()
    run.publish("full")
    print(
        f"published full v1: {args.rows:,} x {args.dim} ({args.codec}) in "
        f"{time.perf_counter() - started:.1f} s",
        file=sys.stderr,
    )
    return run


# --- apply: time vs delta size ------------------------------------------------------------------


def cmd_apply(args: argparse.Namespace) -> dict[str, Any]:
    """Apply time (fetch+verify+decode+swap) and swap pause per delta size, and memory."""
    torch.set_num_threads(args.torch_threads)  # as the server does (settings.torch_threads)
    workdir = Path(tempfile.mkdtemp(prefix="cnr-bench-"))
    try:
        store = open_store(f"file://{workdir}")
        run = prepare_run(store, args)
        sizes = [int(s) for s in args.sizes.split(",")]
        plan: list[tuple[int, int]] = []  # (delta rows, version)
        for size in sizes:
            for _ in range(args.repeats):
                run.touch_rows("embeddings.item", size)
                plan.append((size, run.publish().ref.version))
        run.close()
        del run
        gc.collect()
        before = rss_bytes()
        live = LiveModel(store, MODEL, dlrm_sink(scheme=args.scheme))
        catalog = Catalog(store, MODEL)
        started = time.perf_counter()
        live.pin(1)  # build v1 from the store (the deltas are already committed)
        boot_s = time.perf_counter() - started
        live.unpin()
        after_boot = rss_bytes()
        results: dict[int, list[dict[str, float]]] = {s: [] for s in sizes}
        peak = [after_boot["VmRSS"]]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.005):
                peak[0] = max(peak[0], rss_bytes()["VmRSS"])

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for size, version in plan:
            ref = catalog.find(version)
            t0 = time.perf_counter()
            live.advance(ref)
            seconds = time.perf_counter() - t0
            last = live.last_apply
            assert last is not None
            results[size].append(
                {"apply_s": seconds, "pause_s": last.pause_s, "bytes": float(last.bytes_fetched)}
            )
        stop.set()
        sampler.join()
        rows = []
        for size in sizes:
            per = results[size]
            rows.append(
                {
                    "delta_rows": size,
                    "fraction": round(size / args.rows, 6),
                    "blob_bytes": int(np.mean([x["bytes"] for x in per])),
                    "apply_ms_median": round(
                        1000 * float(np.median([x["apply_s"] for x in per])), 2
                    ),
                    "apply_ms_max": round(1000 * max(x["apply_s"] for x in per), 2),
                    "swap_pause_us_max": round(1e6 * max(x["pause_s"] for x in per), 1),
                }
            )
        doc = {
            "bench": "apply",
            "scheme": args.scheme,
            "rows": args.rows,
            "dim": args.dim,
            "codec": args.codec,
            "bootstrap_s": round(boot_s, 3),
            "model_tensor_bytes": live.nbytes(),
            "rss_growth_after_bootstrap_mib": mib(after_boot["VmRSS"] - before["VmRSS"]),
            "rss_peak_growth_during_applies_mib": mib(peak[0] - before["VmRSS"]),
            "results": rows,
        }
        print(
            f"\napply ({args.scheme}, {args.rows:,} x {args.dim}, {args.codec}): model "
            f"tensors {mib(live.nbytes())} MiB, RSS +{doc['rss_growth_after_bootstrap_mib']} "
            f"MiB after bootstrap, peak +{doc['rss_peak_growth_during_applies_mib']} MiB"
        )
        print(
            f"{'delta rows':>10} {'blob bytes':>12} {'apply ms (median)':>18} {'max':>8} "
            f"{'swap pause us':>14}"
        )
        for r in rows:
            print(
                f"{r['delta_rows']:>10,} {r['blob_bytes']:>12,} {r['apply_ms_median']:>18} "
                f"{r['apply_ms_max']:>8} {r['swap_pause_us_max']:>14}"
            )
        return doc
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# --- pause: in-process readers while deltas apply ------------------------------------------------


def cmd_pause(args: argparse.Namespace) -> dict[str, Any]:
    """Reader threads predict non-stop; deltas apply; measure reader waits and latencies."""
    torch.set_num_threads(args.torch_threads)
    workdir = Path(tempfile.mkdtemp(prefix="cnr-bench-"))
    try:
        store = open_store(f"file://{workdir}")
        run = prepare_run(store, args)
        versions = []
        for _ in range(args.versions):
            run.touch_rows("embeddings.item", args.delta_rows)
            versions.append(run.publish().ref.version)
        config = run.config
        run.close()
        del run
        gc.collect()
        live = LiveModel(store, MODEL, dlrm_sink(scheme=args.scheme))
        live.pin(1)
        live.unpin()
        catalog = Catalog(store, MODEL)
        refs = [catalog.find(v) for v in versions]
        batch = build_batch(random_examples(config, args.batch, seed=1), config)

        phase = ["idle"]
        samples: dict[str, list[tuple[float, float]]] = {"idle": [], "applying": []}
        stop = threading.Event()
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    with live.reader() as buffer:
                        t1 = time.perf_counter()
                        assert buffer.module is not None
                        with torch.inference_mode():
                            buffer.module(batch.dense, batch.sparse)
                    t2 = time.perf_counter()
                    samples[phase[0]].append((t1 - t0, t2 - t0))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=reader, daemon=True) for _ in range(args.readers)]
        for t in threads:
            t.start()
        time.sleep(args.duration)
        phase[0] = "applying"
        apply_times = []
        pauses = []
        started = time.monotonic()
        for ref in refs:
            if time.monotonic() - started > args.duration * 3:
                break
            t0 = time.perf_counter()
            live.advance(ref)
            apply_times.append(time.perf_counter() - t0)
            assert live.last_apply is not None
            pauses.append(live.last_apply.pause_s)
        stop.set()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        doc = {
            "bench": "pause",
            "scheme": args.scheme,
            "rows": args.rows,
            "dim": args.dim,
            "delta_rows": args.delta_rows,
            "readers": args.readers,
            "batch": args.batch,
            "versions_applied": len(apply_times),
            "apply": percentiles(apply_times),
            "writer_swap_pause": percentiles(pauses),
            "idle_reader_wait": percentiles([w for w, _ in samples["idle"]]),
            "applying_reader_wait": percentiles([w for w, _ in samples["applying"]]),
            "idle_predict": percentiles([lat for _, lat in samples["idle"]]),
            "applying_predict": percentiles([lat for _, lat in samples["applying"]]),
            "model_tensor_bytes": live.nbytes(),
            "rss_mib": mib(rss_bytes()["VmRSS"]),
        }
        print(
            f"\npause ({args.scheme}, {args.rows:,} x {args.dim}, deltas of "
            f"{args.delta_rows:,} rows, {args.readers} readers x batch {args.batch}):"
        )
        for key in (
            "apply",
            "writer_swap_pause",
            "idle_reader_wait",
            "applying_reader_wait",
            "idle_predict",
            "applying_predict",
        ):
            print(f"  {key:<22} {doc[key]}")
        print(f"  model tensors {mib(live.nbytes())} MiB")
        return doc
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# --- http: loopback load generator ---------------------------------------------------------------


@dataclass
class LoadResult:
    latencies: list[float] = field(default_factory=list)
    failures: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    versions: set[int] = field(default_factory=set)


def _load_while_publishing(
    url: str,
    body: bytes,
    args: argparse.Namespace,
    run: SyntheticRun,
    table: str,
    delta_rows: int,
) -> tuple[LoadResult, list[int]]:
    """Predict load on `url` (`generate_load`) while a thread touches `delta_rows` rows of
    `table` and publishes a version every `args.interval` s; the load's figures and the
    versions published."""
    stop = threading.Event()
    published: list[int] = []

    def publish_loop() -> None:
        while not stop.wait(args.interval):
            run.touch_rows(table, delta_rows)
            published.append(run.publish().ref.version)

    publisher = threading.Thread(target=publish_loop)
    publisher.start()
    try:
        busy = generate_load(
            url,
            body,
            concurrency=args.concurrency,
            duration=args.duration,
            max_requests=args.max_requests,
        )
    finally:
        stop.set()
        publisher.join()
    return busy, published


def warm_then_idle_load(url: str, body: bytes, args: argparse.Namespace) -> LoadResult:
    """One second of warm-up load, then the measured idle load of `args.duration` s."""
    generate_load(url, body, concurrency=args.concurrency, duration=1.0, max_requests=10**9)
    return generate_load(
        url,
        body,
        concurrency=args.concurrency,
        duration=args.duration,
        max_requests=args.max_requests,
    )


def generate_load(
    url: str, body: bytes, *, concurrency: int, duration: float, max_requests: int
) -> LoadResult:
    """`concurrency` closed-loop clients POST /v1/predict for `duration` s (or max_requests)."""
    result = LoadResult()
    lock = threading.Lock()
    deadline = time.monotonic() + duration
    count = [0]

    def client() -> None:
        with httpx.Client(base_url=url, timeout=30) as c:
            while time.monotonic() < deadline:
                with lock:
                    if count[0] >= max_requests:
                        return
                    count[0] += 1
                t0 = time.perf_counter()
                try:
                    r = c.post(
                        "/v1/predict", content=body, headers={"Content-Type": "application/json"}
                    )
                    status = str(r.status_code)
                    version = r.json().get("version") if r.status_code == 200 else None
                except httpx.HTTPError as exc:
                    status, version = type(exc).__name__, None
                elapsed = time.perf_counter() - t0
                with lock:
                    result.statuses[status] = result.statuses.get(status, 0) + 1
                    if status == "200":
                        result.latencies.append(elapsed)
                        result.versions.add(int(version))  # type: ignore[arg-type]
                    else:
                        result.failures += 1

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return result


def cmd_http(args: argparse.Namespace) -> dict[str, Any]:
    """Predict latency over loopback HTTP: idle, then while deltas are published and applied."""
    workdir = Path(tempfile.mkdtemp(prefix="cnr-bench-"))
    server: ChildServer | None = None
    try:
        store_url = f"file://{workdir / 'store'}"
        bus_url = f"file://{workdir / 'bus.log'}"
        store = open_store(store_url)
        announcer = open_announcer(bus_url, MODEL)
        run = prepare_run(store, args, announce=announcer.announce)
        server = start_server(
            store_url,
            bus_url,
            scheme=args.scheme,
            log_dir=workdir,
            torch_threads=args.torch_threads,
        )
        server.wait_ready(SERVER_START_S)
        body = json.dumps({"examples": random_examples(run.config, args.batch, seed=2)}).encode()
        idle = warm_then_idle_load(server.url, body, args)
        v_before = server.info()["version"]
        busy, published = _load_while_publishing(
            server.url, body, args, run, "embeddings.item", args.delta_rows
        )
        info = server.info()
        rss = rss_bytes(server.proc.pid)
        run.close()
        doc = {
            "bench": "http",
            "scheme": args.scheme,
            "rows": args.rows,
            "dim": args.dim,
            "delta_rows": args.delta_rows,
            "batch": args.batch,
            "concurrency": args.concurrency,
            "idle": {
                **percentiles(idle.latencies),
                "failed": idle.failures,
                "statuses": idle.statuses,
            },
            "applying": {
                **percentiles(busy.latencies),
                "failed": busy.failures,
                "statuses": busy.statuses,
                "versions_seen": len(busy.versions),
            },
            "versions_published": len(published),
            "versions_applied_during_load": info["version"] - v_before,
            "server_rss_mib": mib(rss["VmRSS"]),
            "server_peak_rss_mib": mib(rss["VmHWM"]),
            "server_model_tensor_mib": mib(info["model_memory_bytes"]),
        }
        print(
            f"\nhttp ({args.scheme}, {args.rows:,} x {args.dim}, batch {args.batch}, "
            f"{args.concurrency} clients, deltas of {args.delta_rows:,} rows every "
            f"{args.interval} s):"
        )
        print(f"  idle      {doc['idle']}")
        print(f"  applying  {doc['applying']}")
        print(
            f"  versions applied during load: {doc['versions_applied_during_load']}, server "
            f"RSS {doc['server_rss_mib']} MiB (peak {doc['server_peak_rss_mib']} MiB)"
        )
        return doc
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


# --- quantized: fp32 vs int8 vs int4 tables, side by side -----------------------------------------

#: the arms, as (name, codec published, tables held quantized): today's server holds the int4
#: versions as float32; the others hold each codec's fused rows.
QUANTIZED_ARMS: tuple[tuple[str, str, bool], ...] = (
    ("fp32", "int4", False),
    ("int8", "int8", True),
    ("int4", "int4", True),
)


def synthetic_config(cap: int, dim: int) -> DLRMConfig:
    """The synthetic Criteo-like model: 26 tables capped at `cap` rows (730,000: ~1.08 GB of
    float32 embeddings at dim 64), 13 dense features."""
    return DLRMConfig(
        sparse=tuple(
            SparseFeature(f"c{t + 1}", rows)
            for t, rows in enumerate(criteo_like_cardinalities(cap))
        ),
        dense=tuple(f"d{i}" for i in range(N_DENSE)),
        embedding_dim=dim,
        bottom_mlp=(64,),
        top_mlp=(64, 32),
    )


def _quantized_arm(
    workdir: Path, args: argparse.Namespace, name: str, codec: str, quantized: bool
) -> dict[str, Any]:
    """One arm: publish a full + deltas of `args.delta_rows` rows in `codec`; apply them
    in-process (median apply); then a `checknrun serve` child: resident memory serving HEAD
    (both copies, after the idle phase), predict latency over HTTP idle and while deltas are
    published and applied."""
    root = workdir / name
    store_url, bus_url = f"file://{root / 'store'}", f"file://{root / 'bus.log'}"
    store = open_store(store_url)
    announcer = open_announcer(bus_url, MODEL)
    config = synthetic_config(args.cap, args.dim)
    run = SyntheticRun(store, MODEL, config, codec=codec, announce=announcer.announce)
    big = TABLE_PREFIX + max(config.sparse, key=lambda f: f.rows).name
    delta_rows = min(args.delta_rows, max(f.rows for f in config.sparse))
    run.publish("full")
    versions = []
    for _ in range(args.applies):
        run.touch_rows(big, delta_rows)
        versions.append(run.publish().ref.version)
    # In-process applies, this arm's server alone in memory.
    live = LiveModel(store, MODEL, dlrm_sink(scheme=args.scheme, quantized=quantized))
    live.pin(1)
    live.unpin()
    catalog = Catalog(store, MODEL)
    apply_s = []
    for version in versions:
        t0 = time.perf_counter()
        live.advance(catalog.find(version))
        apply_s.append(time.perf_counter() - t0)
    tensor_bytes = live.nbytes()
    live.close()
    del live
    gc.collect()
    server = start_server(
        store_url, bus_url, scheme=args.scheme, log_dir=root, quantized_tables=quantized
    )
    try:
        server.wait_ready(SERVER_START_S)
        server.wait_version(versions[-1], SERVER_START_S)
        body = json.dumps({"examples": random_examples(config, args.batch, seed=2)}).encode()
        idle = warm_then_idle_load(server.url, body, args)
        # Taken after the idle phase: a bootstrap serves before its second copy is cloned.
        served_rss = rss_bytes(server.proc.pid)["VmRSS"]
        v_before = server.info()["version"]
        busy, _ = _load_while_publishing(server.url, body, args, run, big, delta_rows)
        info = server.info()
        rss = rss_bytes(server.proc.pid)
    finally:
        server.stop()
        run.close()
    return {
        "arm": name,
        "codec": codec,
        "quantized_tables": quantized,
        "delta_rows": delta_rows,
        "apply_ms_median": round(1000 * float(np.median(apply_s)), 2),
        "apply_ms_per_100k_rows": round(1000 * float(np.median(apply_s)) * 100_000 / delta_rows, 2),
        "model_tensor_mib": mib(tensor_bytes),
        "server_rss_mib": mib(served_rss),
        "server_rss_after_load_mib": mib(rss["VmRSS"]),
        "server_peak_rss_mib": mib(rss["VmHWM"]),
        "idle": {**percentiles(idle.latencies), "failed": idle.failures},
        "applying": {**percentiles(busy.latencies), "failed": busy.failures},
        "versions_applied_during_load": info["version"] - v_before,
    }


def cmd_quantized(args: argparse.Namespace) -> dict[str, Any]:
    """fp32 vs int8 vs int4 serving of the synthetic model, measured one arm after the other in
    one run: server memory, apply time per 100k rows, predict p99 over HTTP while applying."""
    workdir = Path(tempfile.mkdtemp(prefix="cnr-bench-"))
    try:
        arms = []
        for name, codec, quantized in QUANTIZED_ARMS:
            print(f"arm {name} ({codec} versions)...", file=sys.stderr)
            arms.append(_quantized_arm(workdir, args, name, codec, quantized))
            shutil.rmtree(workdir / name, ignore_errors=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    base = arms[0]
    for arm in arms:
        arm["vs_fp32"] = {
            "server_rss": round(arm["server_rss_mib"] / base["server_rss_mib"], 3),
            "model_tensors": round(arm["model_tensor_mib"] / base["model_tensor_mib"], 3),
            "apply_per_100k_rows": round(
                arm["apply_ms_per_100k_rows"] / base["apply_ms_per_100k_rows"], 3
            ),
            "applying_p99": round(arm["applying"]["p99_ms"] / base["applying"]["p99_ms"], 3),
        }
    config = synthetic_config(args.cap, args.dim)
    doc = {
        "bench": "quantized",
        "scheme": args.scheme,
        "tables": len(config.sparse),
        "table_cap": args.cap,
        "rows": sum(f.rows for f in config.sparse),
        "dim": args.dim,
        "fp32_embedding_mib": mib(4 * args.dim * sum(f.rows for f in config.sparse)),
        "batch": args.batch,
        "concurrency": args.concurrency,
        "interval_s": args.interval,
        "arms": arms,
    }
    print(
        f"\nquantized serving ({args.scheme}, {doc['tables']} tables, {doc['rows']:,} rows x "
        f"{args.dim} = {doc['fp32_embedding_mib']} MiB fp32; deltas of {arms[0]['delta_rows']:,} "
        f"rows; batch {args.batch}, {args.concurrency} clients):"
    )
    print(
        f"{'arm':>5} {'RSS MiB':>8} {'x fp32':>7} {'tensors':>8} {'apply/100k ms':>14} "
        f"{'x fp32':>7} {'p99 idle':>9} {'p99 applying':>13} {'x fp32':>7} {'failed':>7}"
    )
    for a in arms:
        print(
            f"{a['arm']:>5} {a['server_rss_mib']:>8} {a['vs_fp32']['server_rss']:>7} "
            f"{a['model_tensor_mib']:>8} {a['apply_ms_per_100k_rows']:>14} "
            f"{a['vs_fp32']['apply_per_100k_rows']:>7} {a['idle']['p99_ms']:>9} "
            f"{a['applying']['p99_ms']:>13} {a['vs_fp32']['applying_p99']:>7} "
            f"{a['idle']['failed'] + a['applying']['failed']:>7}"
        )
    if args.png:
        plot_quantized(doc, Path(args.png))
        print(f"figure: {args.png}")
    return doc


def plot_quantized(doc: dict[str, Any], path: Path) -> None:
    """Server memory and predict latency (p50/p99, idle and applying) per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = doc["arms"]
    names = [a["arm"] for a in arms]
    fig, (mem, lat) = plt.subplots(1, 2, figsize=(10, 4))
    mem.bar(names, [a["server_rss_mib"] for a in arms], color=["#888", "#4a7", "#27a"])
    for i, a in enumerate(arms):
        mem.text(i, a["server_rss_mib"], f"{a['server_rss_mib']:.0f}", ha="center", va="bottom")
    mem.set_ylabel("server resident memory (MiB)")
    mem.set_title(f"{doc['scheme']}, both copies")
    x = np.arange(len(arms))
    width = 0.2
    for k, (phase, stat) in enumerate(
        [("idle", "p50_ms"), ("idle", "p99_ms"), ("applying", "p50_ms"), ("applying", "p99_ms")]
    ):
        lat.bar(
            x + (k - 1.5) * width,
            [a[phase][stat] for a in arms],
            width,
            label=f"{phase} {stat[:3]}",
        )
    lat.set_xticks(x, names)
    lat.set_ylabel("predict latency over HTTP (ms)")
    lat.set_title(f"batch {doc['batch']}, {doc['concurrency']} clients")
    lat.legend(fontsize=8)
    fig.suptitle(
        f"fp32 vs int8 vs int4 tables: {doc['tables']} tables, {doc['rows']:,} rows x {doc['dim']}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- freshness: train step -> served -------------------------------------------------------------


def cmd_freshness(args: argparse.Namespace) -> dict[str, Any]:
    """Publish versions at an interval; time from the snapshot (end of the train step) to the
    moment each server serves that version or a newer one (its `applied_at`), and where that
    time went, stage by stage. With `--load-rate`, each server takes that many predict
    requests per second (bench/predict_load.py) throughout."""
    # The trainer's threads, as `checknrun train` sets them (--threads, default 1): with torch's
    # default of one thread per core, the codec's small kernels waited for OpenMP workers on
    # this busy 2-core machine (a 900-row int8 delta encoded in 17 ms p50 instead of 0.7 ms).
    torch.set_num_threads(args.torch_threads)
    workdir = Path(tempfile.mkdtemp(prefix="cnr-bench-"))
    servers: list[ChildServer] = []
    run: SyntheticRun | None = None
    load: LoadProcess | None = None
    try:
        store_url = args.store or f"file://{workdir / 'store'}"
        bus_url = args.bus or f"file://{workdir / 'bus.log'}"
        store = open_store(store_url)
        announcer = open_announcer(bus_url, MODEL)
        run = prepare_run(store, args, announce=announcer.announce)
        announcer.flush(10)
        for _ in range(args.servers):
            servers.append(start_server(store_url, bus_url, scheme=args.scheme, log_dir=workdir))
        for s in servers:
            s.wait_ready(SERVER_START_S)
        if args.load_rate:
            body_file = workdir / "predict.json"
            examples = random_examples(run.config, args.load_batch, seed=2)
            body_file.write_text(json.dumps({"examples": examples}), encoding="utf-8")
            load = LoadProcess([s.url for s in servers], body_file, args.load_rate)
            load.start()
            time.sleep(2.0)  # the clients connect and the servers warm up before versions come
        taken: dict[int, float] = {}
        created: dict[int, float] = {}
        committed: dict[int, float] = {}
        encode_s: dict[int, float] = {}
        served_at: list[dict[int, float]] = [{} for _ in servers]
        applies: list[dict[int, dict[str, Any]]] = [{} for _ in servers]
        on_bus: dict[int, float] = {}
        stop = threading.Event()

        def watch(i: int, server: ChildServer) -> None:
            last = 0
            with httpx.Client(base_url=server.url, timeout=5) as c:
                while not stop.is_set():
                    try:
                        info = c.get("/v1/model").json()
                    except httpx.HTTPError:
                        continue
                    if info["version"] > last:
                        applied = _ts(info["applied_at"])
                        for v in range(last + 1, info["version"] + 1):
                            served_at[i].setdefault(v, applied)
                        if info.get("last_apply"):
                            applies[i][info["version"]] = info["last_apply"]
                        last = info["version"]
                    time.sleep(args.poll_s)

        def tap(source: AnnouncementSource) -> None:
            """When each announcement can be read off the bus (an idle reader's view)."""
            while not stop.is_set():
                for raw in source.poll(0.2):
                    on_bus.setdefault(Announcement.from_json(raw).version, time.time())

        bus_reader = open_source(bus_url)
        bus_reader.start_reading()
        threads = [
            threading.Thread(target=watch, args=(i, s), daemon=True) for i, s in enumerate(servers)
        ]
        threads.append(threading.Thread(target=tap, args=(bus_reader,), daemon=True))
        for t in threads:
            t.start()
        for _ in range(args.versions):
            time.sleep(args.interval)
            run.train(args.steps_per_version, rows_per_step=args.rows_per_step)
            result = run.publish()
            v = result.ref.version
            committed[v] = time.time()
            taken[v] = result.taken_at
            encode_s[v] = result.encode_s
            created[v] = result.manifest.created_at.timestamp()
        last_version = max(taken)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(last_version in s for s in served_at):
            time.sleep(0.05)
        load_figures = None if load is None else load.stop()
        stop.set()
        for t in threads:
            t.join(timeout=5)
        bus_reader.close()
        fresh, publish_part, serve_part = [], [], []
        for per_server in served_at:
            for v, t_taken in taken.items():
                if v in per_server:
                    fresh.append(per_server[v] - t_taken)
                    publish_part.append(created[v] - t_taken)
                    serve_part.append(per_server[v] - created[v])
        missing = sum(1 for s in served_at for v in taken if v not in s)
        per_version = _stage_rows(taken, encode_s, created, committed, on_bus, served_at, applies)
        stages = {
            name: percentiles([row[name] for row in per_version if name in row])
            for name in FRESHNESS_STAGES
        }
        sizes = [r.bytes_written for r in run.published[1:]]
        doc = {
            "bench": "freshness",
            "store": store_url.split("://")[0],
            "bus": bus_url.split("://")[0],
            "servers": len(servers),
            "versions": len(taken),
            "interval_s": args.interval,
            "rows": args.rows,
            "dim": args.dim,
            "codec": args.codec,
            "delta_bytes_median": int(np.median(sizes)) if sizes else 0,
            "train_step_to_served": percentiles(fresh),
            "train_step_to_committed": percentiles(publish_part),
            "committed_to_served": percentiles(serve_part),
            "stages": stages,
            "per_version": [{k: round(x, 6) for k, x in row.items()} for row in per_version],
            "predict_load": load_figures,
            "never_seen": missing,
        }
        print(
            f"\nfreshness ({doc['store']} store, {doc['bus']} bus, {len(servers)} servers, "
            f"{len(taken)} versions every {args.interval} s, median delta "
            f"{doc['delta_bytes_median']:,} bytes, predict load "
            f"{args.load_rate or 0} req/s per server, batch {args.load_batch}):"
        )
        for key in ("train_step_to_served", "train_step_to_committed", "committed_to_served"):
            print(f"  {key:<24} {doc[key]}")
        print(f"  {'stage':<24} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}")
        for name, figures in stages.items():
            if figures.get("n"):
                print(
                    f"  {name:<24} {figures['p50_ms']:>9} {figures['p99_ms']:>9} "
                    f"{figures['max_ms']:>9}"
                )
        if load_figures is not None:
            print(f"  predict load             {load_figures}")
        return doc
    finally:
        if load is not None:
            load.kill()
        for s in servers:
            s.stop()
        if run is not None:
            run.close()
        shutil.rmtree(workdir, ignore_errors=True)


#: the stages of `snapshot -> served`, in order, as `_freshness_stages` names them.
FRESHNESS_STAGES = (
    "encode",  # the snapshot encoded (quantized) into blobs
    "upload",  # the blobs written to the store (until the manifest's created_at)
    "commit",  # manifest written, lease renewed, HEAD moved, announcement queued
    "committed_to_on_bus",  # an idle reader of the bus has the announcement
    "committed_to_heard",  # the server's follower has it
    "plan",  # the follower read HEAD and the manifest
    "queue",  # until the apply began
    "fetch_verify",  # blobs fetched, sha256 checked, parsed
    "write_swap",  # decoded, written into the standby copy and swapped in
)


def _stage_rows(
    taken: dict[int, float],
    encode_s: dict[int, float],
    created: dict[int, float],
    committed: dict[int, float],
    on_bus: dict[int, float],
    served_at: list[dict[int, float]],
    applies: list[dict[int, dict[str, Any]]],
) -> list[dict[str, float]]:
    """One row per version and server: the seconds of each stage of `FRESHNESS_STAGES` it
    has, plus `version`, `server` and `served` (snapshot -> served). The server-side stages
    come from the server's `last_apply`, for the versions applied one by one (the usual case;
    a version applied in a plan of several shares its stages with the others)."""
    rows = []
    for i, per_server in enumerate(applies):
        for v, t in taken.items():
            row = {
                "version": float(v),
                "server": float(i),
                "encode": encode_s[v],
                "upload": created[v] - t - encode_s[v],
                "commit": committed[v] - created[v],
            }
            if v in served_at[i]:
                row["served"] = served_at[i][v] - t
            if v in on_bus:
                row["committed_to_on_bus"] = on_bus[v] - committed[v]
            times = per_server.get(v)
            if times is not None and times["heard_at"] is not None and times["versions"] == [v]:
                row["committed_to_heard"] = _ts(times["heard_at"]) - committed[v]
                row["plan"] = times["plan_s"]
                row["queue"] = times["queue_s"]
                row["fetch_verify"] = times["fetch_s"]
                row["write_swap"] = times["write_s"]
            rows.append(row)
    return rows


def _ts(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


# --- command line ---------------------------------------------------------------------------------

#: per command, the sizes `--quick` shrinks: option -> (default, quick). Given options win.
SIZES: dict[str, dict[str, tuple[Any, Any]]] = {
    "apply": {
        "rows": (1_000_000, 5_000),
        "sizes": ("1000,10000,100000,300000", "500,2000"),
        "repeats": (3, 1),
    },
    "pause": {
        "rows": (1_000_000, 5_000),
        "delta_rows": (100_000, 500),
        "versions": (10, 3),
        "duration": (5.0, 1.0),
    },
    "http": {"rows": (1_000_000, 5_000), "duration": (15.0, 1.0), "max_requests": (100_000, 200)},
    "quantized": {
        "cap": (730_000, 2_000),
        "delta_rows": (100_000, 500),
        "applies": (5, 2),
        "duration": (15.0, 1.0),
        "max_requests": (100_000, 200),
    },
    "freshness": {
        "rows": (100_000, 5_000),
        "servers": (2, 1),
        "versions": (40, 4),
        "interval": (1.0, 0.3),
    },
}
COMMANDS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "apply": cmd_apply,
    "pause": cmd_pause,
    "http": cmd_http,
    "freshness": cmd_freshness,
    "quantized": cmd_quantized,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`[--max-seconds S] {apply,pause,http,freshness} [options]`."""
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=900.0,
        help="abort the whole run after this long (default %(default)s)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        add_run_options(p, inherited=True)
        return p

    def sized(p: argparse.ArgumentParser, name: str, flag: str, kind: type, help: str) -> None:
        """An option of command `name` whose default `--quick` shrinks (SIZES)."""
        full, quick = SIZES[name][flag.removeprefix("--").replace("-", "_")]
        p.add_argument(flag, type=kind, help=f"{help} (default {full}; --quick {quick})")

    def common(p: argparse.ArgumentParser, name: str, dim: int = 64) -> None:
        sized(p, name, "--rows", int, "rows of the big table")
        p.add_argument("--dim", type=int, default=dim)
        p.add_argument("--codec", default="int8")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--scheme", choices=["double-buffer", "rwlock"], default="double-buffer")
        p.add_argument("--torch-threads", type=int, default=1)

    p = command("apply", "apply time vs delta size, and memory")
    common(p, "apply")
    sized(p, "apply", "--sizes", str, "delta sizes in rows, comma separated")
    sized(p, "apply", "--repeats", int, "applies per size")

    p = command("pause", "worst predict pause while deltas apply (in-process)")
    common(p, "pause")
    sized(p, "pause", "--delta-rows", int, "rows per delta")
    sized(p, "pause", "--versions", int, "deltas applied")
    p.add_argument("--readers", type=int, default=2)
    p.add_argument("--batch", type=int, default=256)
    sized(p, "pause", "--duration", float, "seconds of the idle phase")

    p = command("http", "predict latency over loopback HTTP, idle vs applying")
    common(p, "http")
    p.add_argument("--delta-rows", type=int, default=10_000)
    p.add_argument("--interval", type=float, default=0.5, help="seconds between deltas")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    sized(p, "http", "--duration", float, "seconds per phase")
    sized(p, "http", "--max-requests", int, "requests per phase at most")

    p = command("quantized", "fp32 vs int8 vs int4 tables: memory, apply, HTTP p99")
    sized(p, "quantized", "--cap", int, "rows cap of the 26 synthetic tables (730k: 1.08 GB)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--scheme", choices=["double-buffer", "rwlock"], default="double-buffer")
    sized(p, "quantized", "--delta-rows", int, "rows per delta (of the largest table)")
    sized(p, "quantized", "--applies", int, "in-process applies per arm")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between deltas")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    sized(p, "quantized", "--duration", float, "seconds per load phase")
    sized(p, "quantized", "--max-requests", int, "requests per phase at most")
    p.add_argument("--png", help="write the figure (memory, latency per arm) to this PNG")

    p = command("freshness", "train step -> served latency (p50/p99)")
    common(p, "freshness", dim=32)
    p.add_argument("--store", help="store URL (default: a temporary file:// store)")
    p.add_argument("--bus", help="bus URL (default: a temporary file:// log)")
    sized(p, "freshness", "--servers", int, "servers following")
    sized(p, "freshness", "--versions", int, "versions published")
    sized(p, "freshness", "--interval", float, "seconds between versions")
    p.add_argument("--steps-per-version", type=int, default=5)
    p.add_argument("--rows-per-step", type=int, default=512)
    # The servers stamp applied_at themselves: the watcher only has to see each version's
    # last_apply before the next one replaces it. At 5 ms the two watchers sent 400 GET
    # /v1/model a second, 10x the predict load, competing for the GIL with the follow loop.
    p.add_argument("--poll-s", type=float, default=0.05, help="watcher poll interval")
    p.add_argument(
        "--load-rate",
        type=float,
        default=0.0,
        help="predict requests per second to each server while measuring (default 0: none)",
    )
    p.add_argument("--load-batch", type=int, default=64, help="examples per predict request")


def run(quick: bool, *, command: str, max_seconds: float = 900.0, **options: Any) -> dict[str, Any]:
    """One serving measurement, aborted after `max_seconds`; prints its summary.

    `options` are the command's (see add_arguments); sizes left None take SIZES' value.
    """
    for name, (full, small) in SIZES[command].items():
        if options.get(name) is None:
            options[name] = small if quick else full
    with time_limit(max_seconds):
        doc = COMMANDS[command](argparse.Namespace(**options))
    return {**doc, "quick": quick, "machine": describe_machine()}
