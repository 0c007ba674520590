"""Part `usermodel`: a user's own model served by `--model-factory` next to the built-in DLRM of
the same table sizes, side by side in one run.

    checknrun bench usermodel [--items 1000000] [--users 100000] [--dim 64] [--codecs int4,fp32]
                              [--delta-sizes 10000,100000] [--repeats 15] [--batches 1,64]
                              [--requests 2000] [--rounds 4] [--quick] [--json OUT]

The user model is examples/two_tower.py (tables `user`, `history`, `item`, `category`; raw string
ids of users and items through id maps, every row but the unknown row held by an id), written by
the trainer's `IncrementalCheckpointer` (consecutive policy). The DLRM has tables of the same
rows and dimension (`user`, `history`, `item`, `category`, and one dense feature) and an MLP of
about the same parameters, written by `bench.synthetic_run.SyntheticRun`. Both publish to file://
stores in each codec of `--codecs`. Rows change without training: a delta of N rows is N rows
edited in place and marked dirty. Every table is under plain SGD, so a blob carries rows only
on both sides (no optimizer columns). Measured, per codec:

- apply: in this process, `LiveModel.advance` of each delta (fetch, verify, decode, write, swap)
  into the sink `checknrun serve` builds (`ModuleSink(two_tower.build)` / `dlrm_sink()`,
  double-buffer, quantized tables), torch on one thread as the server runs it. Three series
  alternate delta by delta, their order rotating: the user model's `item` table (its rows with
  their id-map entries), its `history` table (rows only, no id map: the like-for-like of the
  DLRM's) and the DLRM's `item` table. Medians over `--repeats`: ms, ms per 100k rows, where
  they went (`LiveModel.last_times`: fetch + verify + parse; decode + write + swap; draining and
  levelling the copy swapped out), the swap pause (`UpdateResult.pause_s`), bytes fetched; and
  each arm's model memory (both copies; the user model's id maps apart).
- forward: the served copy's own forward at each batch of `--batches`, inputs built
  beforehand: the floor under a request's latency, arms alternating.
- http: a real `checknrun serve` child per arm (the user model with `--model-factory
  examples.two_tower:build --request-adapter examples.two_tower:requests`, the DLRM plain), both
  serving HEAD; sequential keep-alive POST /v1/predict from one httpx client, after a warm-up,
  in `--rounds` blocks per arm alternating (the order flipping each round: AB BA AB...). Both
  arms are sent the same rows (raw ids `u<row>`, `i<row>` to the user model). p50/p99 over every
  block, and each block's p50 (how far the machine moved); each server's memory.

The ratios (user model / DLRM) are what to read: the machine is shared and noisy, and the two
arms ran interleaved on it.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from bench.child_server import ChildServer
from bench.machine import describe_machine, log
from bench.predict_load import RequestSamples, percentiles, post_sequentially
from bench.serving import SERVER_START_S, mib, rss_bytes, time_limit
from bench.synthetic_run import SyntheticRun
from bench.two_tower_writer import TwoTowerWriter
from examples import two_tower
from publisher.cli import positive_int
from publisher.dlrm import TABLE_PREFIX, DLRMConfig, SparseFeature
from publisher.read.catalog import Catalog
from publisher.read.live_model import LiveModel
from publisher.read.sinks import ModuleSink, VersionSink, dlrm_sink
from publisher.store import ObjectStore, open_store
from server.feature_batch import build_batch

#: option -> (default, --quick). Given options win.
SIZES: dict[str, tuple[Any, Any]] = {
    "items": (1_000_000, 20_000),
    "users": (100_000, 5_000),
    "delta_sizes": ("10000,100000", "1000,5000"),
    "repeats": (15, 2),
    "requests": (2000, 40),
    "rounds": (4, 2),
    "warmup": (100, 5),
}
USER, DLRM = "two_tower", "dlrm"
#: the serve flags of each arm (the DLRM is the server's default model).
SERVE_FLAGS: dict[str, dict[str, str]] = {
    USER: {
        "model_factory": "examples.two_tower:build",
        "request_adapter": "examples.two_tower:requests",
    },
    DLRM: {},
}
#: distinct request bodies per batch size, sent in turn.
BODIES = 8


@dataclass(frozen=True)
class Series:
    """Deltas of one table of one arm's model."""

    name: str
    arm: str
    table: str
    id_mapped: bool


SERIES = (
    Series("two_tower item (id map)", USER, "item", True),
    Series("two_tower history", USER, "history", False),
    Series("dlrm item", DLRM, TABLE_PREFIX + "item", False),
)


# --- the two models and their writers ------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The tables and MLP width both arms share."""

    items: int
    users: int
    categories: int
    dim: int
    hidden: int

    def two_tower(self) -> two_tower.TwoTowerConfig:
        """The user model (`examples.two_tower`)."""
        return two_tower.TwoTowerConfig(
            users=self.users,
            items=self.items,
            categories=self.categories,
            dim=self.dim,
            hidden=self.hidden,
        )

    def dlrm(self) -> DLRMConfig:
        """The DLRM of the same tables (rows and dim) and one dense feature; its MLPs (hidden,
        then 2*hidden and hidden on top) hold about as many parameters as the two towers."""
        return DLRMConfig(
            sparse=(
                SparseFeature("user", self.users),
                SparseFeature("history", self.items, bag=True),
                SparseFeature("item", self.items),
                SparseFeature("category", self.categories, bag=True),
            ),
            dense=("d0",),
            embedding_dim=self.dim,
            bottom_mlp=(self.hidden,),
            top_mlp=(2 * self.hidden, self.hidden),
        )


def dense_parameters(model: nn.Module) -> int:
    """Parameters outside the embedding tables (the MLPs)."""
    tables = {
        id(p)
        for m in model.modules()
        if isinstance(m, nn.Embedding | nn.EmbeddingBag)
        for p in m.parameters()
    }
    return sum(p.numel() for p in model.parameters() if id(p) not in tables)


class VersionWriter(Protocol):
    """What publishes one arm's versions."""

    def touch_rows(self, table: str, n_rows: int) -> None:
        """Change exactly `n_rows` distinct rows of `table`, for the next version."""

    def publish(self, full: bool = False) -> int:
        """Commit the rows changed since the last version (or every row); the version."""

    def close(self) -> None: ...


class DLRMWriter:
    """The DLRM's versions through `SyntheticRun`, with `TwoTowerWriter`'s two calls."""

    def __init__(self, store_url: str, name: str, config: DLRMConfig, codec: str, seed: int):
        self.store = open_store(store_url)
        self.run = SyntheticRun(self.store, name, config, codec=codec, seed=seed)

    def touch_rows(self, table: str, n_rows: int) -> None:
        self.run.touch_rows(table, n_rows)

    def publish(self, full: bool = False) -> int:
        return self.run.publish("full" if full else "delta").ref.version

    def close(self) -> None:
        self.run.close()
        self.store.close()


# --- requests: the same rows for both arms -------------------------------------------------------


@dataclass(frozen=True)
class Requests:
    """One batch of draws in the three forms the measurements send."""

    user_raw: list[dict[str, Any]]  # raw ids, as a client sends them to the user model
    user_rows: list[dict[str, Any]]  # the same with rows, as the adapter gets them mapped
    dlrm: list[dict[str, Any]]  # the same rows in the DLRM's request format


def draw_requests(
    config: two_tower.TwoTowerConfig, batch: int, rng: np.random.Generator
) -> Requests:
    """`batch` examples of known users and items (rows >= 1), 0-3 history items, 1-2
    categories."""
    user_raw, user_rows, dlrm = [], [], []
    for _ in range(batch):
        user = int(rng.integers(1, config.users))
        item = int(rng.integers(1, config.items))
        history = rng.integers(0, config.items, int(rng.integers(0, 4))).tolist()
        categories = rng.integers(0, config.categories, int(rng.integers(1, 3))).tolist()
        shared = {"history": history, "categories": categories}
        user_raw.append({"user": f"u{user}", "item": f"i{item}", **shared})
        user_rows.append({"user": user, "item": item, **shared})
        dlrm.append(
            {
                "d0": round(float(rng.normal()), 4),
                "user": user,
                "item": item,
                "history": history,
                "category": categories,
            }
        )
    return Requests(user_raw, user_rows, dlrm)


def alternating(arms: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, arm) for `rounds` rounds of every arm, the order flipping each round (ABBA...)."""
    for r in range(rounds):
        for arm in arms if r % 2 == 0 else reversed(arms):
            yield r, arm


# --- apply ---------------------------------------------------------------------------------------


def apply_plan(sizes: Sequence[int], repeats: int) -> list[tuple[Series, int]]:
    """Which delta comes when: every series once per size and repeat, the order rotating."""
    plan = []
    for r in range(repeats):
        for j, size in enumerate(sizes):
            turn = (r * len(sizes) + j) % len(SERIES)
            for series in SERIES[turn:] + SERIES[:turn]:
                plan.append((series, size))
    return plan


def sinks() -> dict[str, VersionSink]:
    """The sink `checknrun serve` builds for each arm (defaults: double-buffer, quantized)."""
    return {USER: ModuleSink(two_tower.build), DLRM: dlrm_sink()}


def measure_apply(
    stores: dict[str, ObjectStore], plan: Sequence[tuple[Series, int, int]]
) -> tuple[dict[str, LiveModel], list[dict[str, Any]], dict[str, float]]:
    """Bootstrap v1 of each arm, then advance through `plan` (series, rows, version) in order:
    the live models (at HEAD), one row per series and size, and the bootstrap seconds."""
    lives: dict[str, LiveModel] = {}
    boot: dict[str, float] = {}
    for arm, sink in sinks().items():
        lives[arm] = LiveModel(stores[arm], arm, sink)
        started = time.perf_counter()
        lives[arm].pin(1)  # v1 from the store: the deltas are committed already
        boot[arm] = round(time.perf_counter() - started, 3)
        lives[arm].unpin()
    catalogs = {arm: Catalog(live.store, arm) for arm, live in lives.items()}
    samples: dict[tuple[str, int], list[dict[str, float]]] = {}
    for series, size, version in plan:
        live = lives[series.arm]
        ref = catalogs[series.arm].find(version)
        gc.collect()  # outside the timing: no collection lands in one arm's apply
        started = time.perf_counter()
        live.advance(ref)
        seconds = time.perf_counter() - started
        last, times = live.last_apply, live.last_times
        assert last is not None and times is not None
        samples.setdefault((series.name, size), []).append(
            {
                "apply": seconds,
                "fetch": times.fetch_s,
                # decode, write into the standby copy, swap
                "write": times.served_at - times.started_at - times.fetch_s,
                # drain the copy swapped out and bring it level
                "level": times.finished_at - times.served_at,
                "pause": last.pause_s,
                "bytes": last.bytes_fetched,
            }
        )
    rows: list[dict[str, Any]] = []
    for (name, size), per in samples.items():

        def median(key: str, per: list[dict[str, float]] = per) -> float:
            return statistics.median(x[key] for x in per)

        apply_ms = 1000 * median("apply")
        rows.append(
            {
                "series": name,
                "delta_rows": size,
                "n": len(per),
                "apply_ms_median": round(apply_ms, 2),
                "apply_ms_min": round(1000 * min(x["apply"] for x in per), 2),
                "apply_ms_max": round(1000 * max(x["apply"] for x in per), 2),
                "apply_ms_per_100k_rows": round(apply_ms * 100_000 / size, 2),
                "fetch_ms_median": round(1000 * median("fetch"), 2),
                "write_ms_median": round(1000 * median("write"), 2),
                "level_ms_median": round(1000 * median("level"), 2),
                "pause_us_median": round(1e6 * median("pause"), 1),
                "pause_us_max": round(1e6 * max(x["pause"] for x in per), 1),
                "bytes_fetched_median": int(median("bytes")),
            }
        )
    rows.sort(key=lambda r: ([s.name for s in SERIES].index(r["series"]), r["delta_rows"]))
    return lives, rows, boot


def apply_ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per delta size: each user-model series over the DLRM's (apply median, pause median)."""
    by = {(r["series"], r["delta_rows"]): r for r in rows}
    base = SERIES[-1].name
    out = []
    for size in sorted({r["delta_rows"] for r in rows}):
        dlrm = by[(base, size)]
        ratio: dict[str, Any] = {"delta_rows": size}
        for series in SERIES[:-1]:
            mine = by[(series.name, size)]
            ratio[series.name] = {
                "apply": round(mine["apply_ms_median"] / dlrm["apply_ms_median"], 3),
                "pause": round(mine["pause_us_median"] / max(dlrm["pause_us_median"], 1e-3), 3),
                "bytes": round(mine["bytes_fetched_median"] / dlrm["bytes_fetched_median"], 3),
            }
        out.append(ratio)
    return out


# --- predict: the forward in-process, then over HTTP ---------------------------------------------


def measure_forward(
    lives: dict[str, LiveModel],
    requests: dict[int, list[Requests]],
    rounds: int,
    calls: int,
) -> dict[str, dict[str, Any]]:
    """The served copy's own forward per batch (`calls` per arm), inputs built beforehand,
    arms alternating."""
    out: dict[str, dict[str, Any]] = {}
    with lives[USER].reader() as copy:
        adapter = two_tower.requests(copy.model_config)
    with lives[DLRM].reader() as copy:
        config = DLRMConfig.from_json(copy.model_config)
    for batch, drawn in requests.items():
        inputs: dict[str, list[tuple[Any, ...]]] = {
            USER: [adapter.inputs(d.user_rows) for d in drawn],
            DLRM: [(f.dense, f.sparse) for f in (build_batch(d.dlrm, config) for d in drawn)],
        }
        for arm in (USER, DLRM):  # warm-up
            _forward_calls(lives[arm], inputs[arm], len(drawn))
        times: dict[str, list[float]] = {USER: [], DLRM: []}
        for _, arm in alternating((USER, DLRM), rounds):
            times[arm] += _forward_calls(lives[arm], inputs[arm], max(calls // rounds, 1))
        out[str(batch)] = {arm: percentiles(t) for arm, t in times.items()}
    return out


def _forward_calls(live: LiveModel, inputs: Sequence[tuple[Any, ...]], n: int) -> list[float]:
    """`n` forwards of the served copy, inputs in turn: seconds each."""
    times = []
    with live.reader() as copy, torch.inference_mode():
        module = copy.module
        assert module is not None
        for i in range(n):
            args = inputs[i % len(inputs)]
            started = time.perf_counter()
            module(*args)
            times.append(time.perf_counter() - started)
    return times


def start_servers(
    stores: dict[str, str], versions: dict[str, int], workdir: Path
) -> dict[str, ChildServer]:
    """A `checknrun serve` per arm (started together), each serving its HEAD."""
    servers: dict[str, ChildServer] = {}
    started = time.monotonic()
    try:
        for arm, flags in SERVE_FLAGS.items():
            servers[arm] = ChildServer(
                stores[arm],
                arm,
                workdir / f"server-{arm}.log",
                log_level="warning",
                model_factory=flags.get("model_factory"),
                request_adapter=flags.get("request_adapter"),
            )
        for arm, server in servers.items():
            server.wait_ready(SERVER_START_S)
            server.wait_version(versions[arm], SERVER_START_S)
            log(
                f"usermodel: {arm} server serves v{versions[arm]}, "
                f"{time.monotonic() - started:.1f} s after start"
            )
    except BaseException:
        for server in servers.values():
            server.kill()
        raise
    return servers


@dataclass
class HttpSamples(RequestSamples):
    """One arm's answers at one batch size: seconds of each, and the failures."""

    #: the p50 of each round (ms): how much the machine moved during the run.
    round_p50_ms: list[float] = field(default_factory=list)


def _post(server: ChildServer, bodies: Sequence[bytes], n: int, into: HttpSamples) -> None:
    """`n` sequential POST /v1/predict on the server's keep-alive client, bodies in turn."""
    post_sequentially(server.client, "/v1/predict", bodies, n, into)


def measure_http(
    servers: dict[str, ChildServer],
    requests: dict[int, list[Requests]],
    n_requests: int,
    rounds: int,
    warmup: int,
) -> dict[str, dict[str, Any]]:
    """Sequential keep-alive requests per batch: a warm-up per arm, then `rounds` blocks of
    `n_requests / rounds` per arm, alternating."""
    out: dict[str, dict[str, Any]] = {}
    for batch, drawn in requests.items():
        bodies = {
            USER: [json.dumps({"examples": d.user_raw}).encode() for d in drawn],
            DLRM: [json.dumps({"examples": d.dlrm}).encode() for d in drawn],
        }
        for arm, server in servers.items():
            _post(server, bodies[arm], warmup, HttpSamples())
        samples = {arm: HttpSamples() for arm in servers}
        for _, arm in alternating((USER, DLRM), rounds):
            before = len(samples[arm].latencies)
            _post(servers[arm], bodies[arm], max(n_requests // rounds, 1), samples[arm])
            block = samples[arm].latencies[before:]
            if block:
                samples[arm].round_p50_ms.append(round(1000 * statistics.median(block), 3))
        out[str(batch)] = {
            arm: {
                **percentiles(s.latencies),
                "round_p50_ms": s.round_p50_ms,
                "failed": s.failed,
                "first_error": s.first_error,
            }
            for arm, s in samples.items()
        }
        for arm, s in samples.items():
            if s.failed:
                log(f"usermodel: {arm} batch {batch}: {s.failed} failed, first: {s.first_error}")
    return out


def predict_ratios(
    forward: dict[str, dict[str, Any]], http: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per batch: user model / DLRM (http and forward), and http / forward per arm."""

    def ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
        return round(a[key] / b[key], 3) if a.get(key) and b.get(key) else None

    out = []
    for batch in http:
        h, f = http[batch], forward[batch]
        out.append(
            {
                "batch": int(batch),
                "http_p50": ratio(h[USER], h[DLRM], "p50_ms"),
                "http_p99": ratio(h[USER], h[DLRM], "p99_ms"),
                "forward_p50": ratio(f[USER], f[DLRM], "p50_ms"),
                "forward_p99": ratio(f[USER], f[DLRM], "p99_ms"),
                "http_over_forward_p50": {
                    arm: ratio(h[arm], f[arm], "p50_ms") for arm in (USER, DLRM)
                },
            }
        )
    return out


# --- one codec, end to end -----------------------------------------------------------------------


Plan = list[tuple[Series, int, int]]  # (series, rows, version), in the order applied


def publish_versions(
    stores: dict[str, str],
    shape: ModelShape,
    codec: str,
    sizes: Sequence[int],
    options: dict[str, Any],
) -> tuple[Plan, dict[str, Any]]:
    """Both models' full versions, then every delta of `apply_plan`: the plan, and what the
    writers tell (full publish seconds, dense parameters)."""
    user = TwoTowerWriter(stores[USER], USER, shape.two_tower(), codec=codec, seed=options["seed"])
    dlrm = DLRMWriter(stores[DLRM], DLRM, shape.dlrm(), codec, options["seed"])
    writers: dict[str, VersionWriter] = {USER: user, DLRM: dlrm}
    facts: dict[str, Any] = {
        "dense_parameters": {
            USER: dense_parameters(user.model),
            DLRM: dense_parameters(dlrm.run.model),
        },
        "full_publish_s": {},
    }
    try:
        for arm, writer in writers.items():
            started = time.perf_counter()
            writer.publish(full=True)
            facts["full_publish_s"][arm] = round(time.perf_counter() - started, 2)
        plan = []
        for series, size in apply_plan(sizes, options["repeats"]):
            writers[series.arm].touch_rows(series.table, size)
            plan.append((series, size, writers[series.arm].publish()))
    finally:
        for writer in writers.values():
            writer.close()
    return plan, facts


def measure_in_process(
    stores: dict[str, str], plan: Plan, requests: dict[int, list[Requests]], options: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Applies, then the served copies' forward, torch on one thread as the server runs:
    (apply figures, forward figures)."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # settings.torch_threads
    readers = {arm: open_store(url, create=False) for arm, url in stores.items()}
    lives: dict[str, LiveModel] = {}
    try:
        lives, rows, boot = measure_apply(readers, plan)
        forward = measure_forward(lives, requests, options["rounds"], options["requests"])
        with lives[USER].reader() as copy:
            id_map_bytes = sum(m.nbytes for m in copy.id_maps.values())
        apply = {
            "bootstrap_v1_s": boot,
            "results": rows,
            "user_over_dlrm": apply_ratios(rows),
            # every copy (double-buffer: two): tables, dense tensors and id maps
            "model_memory_mib": {arm: mib(live.nbytes()) for arm, live in lives.items()},
            "two_tower_id_maps_mib_per_copy": mib(id_map_bytes),
        }
    finally:
        for live in lives.values():
            live.close()
        for store in readers.values():
            store.close()
        torch.set_num_threads(previous_threads)
    return apply, forward


def measure_served(
    stores: dict[str, str],
    heads: dict[str, int],
    requests: dict[int, list[Requests]],
    options: dict[str, Any],
    workdir: Path,
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """A `checknrun serve` per arm at its HEAD: (http figures, each server's memory)."""
    servers = start_servers(stores, heads, workdir)
    try:
        http = measure_http(
            servers, requests, options["requests"], options["rounds"], options["warmup"]
        )
        served = {}
        for arm, server in servers.items():
            info = server.info()
            rss = rss_bytes(server.proc.pid)
            served[arm] = {
                "version": info["version"],
                "architecture": info.get("architecture"),
                "model_memory_mib": mib(info["model_memory_bytes"]),
                "rss_mib": mib(rss["VmRSS"]),
                "peak_rss_mib": mib(rss["VmHWM"]),
            }
    finally:
        for server in servers.values():
            server.stop()
    return http, served


def measure_codec(
    codec: str, shape: ModelShape, options: dict[str, Any], workdir: Path
) -> dict[str, Any]:
    """Publish both models in `codec`, then apply, forward and http, arms side by side."""
    sizes = [int(s) for s in str(options["delta_sizes"]).split(",")]
    stores = {arm: f"file://{workdir / codec / arm}" for arm in (USER, DLRM)}
    log(f"usermodel {codec}: publishing both models ({shape.items:,} item rows x {shape.dim})")
    plan, facts = publish_versions(stores, shape, codec, sizes, options)
    gc.collect()  # the writers' models and copies
    rng = np.random.default_rng(options["seed"] + 1)
    requests = {
        b: [draw_requests(shape.two_tower(), b, rng) for _ in range(BODIES)]
        for b in options["batches"]
    }
    log(f"usermodel {codec}: {len(plan)} deltas applied in process, then the forward")
    apply, forward = measure_in_process(stores, plan, requests, options)
    gc.collect()
    heads = {arm: max(v for s, _, v in plan if s.arm == arm) for arm in (USER, DLRM)}
    log(f"usermodel {codec}: a server per arm, http at batches {options['batches']}")
    http, served = measure_served(stores, heads, requests, options, workdir / codec)
    return {
        "codec": codec,
        **facts,
        "apply": apply,
        "forward": forward,
        "http": http,
        "predict_user_over_dlrm": predict_ratios(forward, http),
        "servers": served,
    }


def run(
    quick: bool,
    *,
    items: int | None = None,
    users: int | None = None,
    categories: int = 1_000,
    dim: int = 64,
    hidden: int = 128,
    codecs: str = "int4",
    delta_sizes: str | None = None,
    repeats: int | None = None,
    batches: str = "1,64",
    requests: int | None = None,
    rounds: int | None = None,
    warmup: int | None = None,
    seed: int = 0,
    max_seconds: float = 900.0,
) -> dict[str, Any]:
    """Every measurement for each codec; prints the tables and returns the document."""
    given = {
        "items": items,
        "users": users,
        "delta_sizes": delta_sizes,
        "repeats": repeats,
        "requests": requests,
        "rounds": rounds,
        "warmup": warmup,
    }
    options: dict[str, Any] = {
        k: (v if v is not None else SIZES[k][1 if quick else 0]) for k, v in given.items()
    }
    options.update(
        categories=categories,
        dim=dim,
        hidden=hidden,
        seed=seed,
        batches=[int(b) for b in batches.split(",")],
    )
    shape = ModelShape(options["items"], options["users"], categories, dim, hidden)
    largest = max(int(s) for s in str(options["delta_sizes"]).split(","))
    if largest > options["items"] // 2:
        raise ValueError(f"deltas of {largest:,} rows need --items of at least twice as many")
    machine = describe_machine()
    workdir = Path(tempfile.mkdtemp(prefix="cnr-usermodel-"))
    try:
        with time_limit(max_seconds):
            results = {c: measure_codec(c, shape, options, workdir) for c in codecs.split(",")}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    doc = {
        "part": "usermodel",
        "config": {
            **options,
            "codecs": codecs.split(","),
            "two_tower": shape.two_tower().to_json(),
            "dlrm": shape.dlrm().to_json(),
            "series": [vars(s) for s in SERIES],
            "serve_flags": SERVE_FLAGS,
            "consistency": "double-buffer",
            "quantized_tables": True,
            "torch_threads": 1,
        },
        "codecs": results,
        "quick": quick,
        "machine": machine,
        "load_average_end": describe_machine()["load_average"],
    }
    print_tables(doc)
    return doc


def print_tables(doc: dict[str, Any]) -> None:
    c = doc["config"]
    for codec, r in doc["codecs"].items():
        print(
            f"\nusermodel, {codec}: two_tower (--model-factory) vs dlrm, tables "
            f"{c['items']:,} items x {c['dim']}, {c['users']:,} users, {c['categories']:,} "
            f"categories; dense params {r['dense_parameters'][USER]:,} vs "
            f"{r['dense_parameters'][DLRM]:,}"
        )
        print(
            f"apply in process, median of {c['repeats']} (ms: fetch+verify, decode+write+swap, "
            "level the old copy; pause: the swap, us)"
        )
        print(
            f"{'series':<24} {'rows':>8} {'ms':>8} {'ms/100k':>8} {'x dlrm':>7} {'fetch':>7} "
            f"{'write':>7} {'level':>7} {'pause':>7} {'bytes':>11}"
        )
        ratios = {x["delta_rows"]: x for x in r["apply"]["user_over_dlrm"]}
        for row in r["apply"]["results"]:
            x = ratios[row["delta_rows"]].get(row["series"], {}).get("apply", 1.0)
            print(
                f"{row['series']:<24} {row['delta_rows']:>8,} {row['apply_ms_median']:>8} "
                f"{row['apply_ms_per_100k_rows']:>8} {x:>7} {row['fetch_ms_median']:>7} "
                f"{row['write_ms_median']:>7} {row['level_ms_median']:>7} "
                f"{row['pause_us_median']:>7} {row['bytes_fetched_median']:>11,}"
            )
        memory = r["apply"]["model_memory_mib"]
        print(
            f"model memory, both copies: two_tower {memory[USER]} MiB (id maps "
            f"{r['apply']['two_tower_id_maps_mib_per_copy']} MiB a copy), dlrm {memory[DLRM]} MiB"
        )
        print("predict, ms (http: sequential keep-alive `serve`; forward: the copy in process)")
        print(
            f"{'batch':>5} {'arm':<10} {'http p50':>9} {'http p99':>9} {'fwd p50':>8} "
            f"{'fwd p99':>8} {'failed':>6}"
        )
        for batch, http in r["http"].items():
            for arm in (USER, DLRM):
                h, f = http[arm], r["forward"][batch][arm]
                print(
                    f"{batch:>5} {arm:<10} {h.get('p50_ms', '-'):>9} {h.get('p99_ms', '-'):>9} "
                    f"{f.get('p50_ms', '-'):>8} {f.get('p99_ms', '-'):>8} {h['failed']:>6}"
                )
        for x in r["predict_user_over_dlrm"]:
            print(
                f"{x['batch']:>5} {'x dlrm':<10} {x['http_p50']:>9} {x['http_p99']:>9} "
                f"{x['forward_p50']:>8} {x['forward_p99']:>8}"
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Sizes (unset: SIZES' full or --quick value), codecs, batches and the time limit."""
    sized: dict[str, tuple[Callable[[str], int | str], str]] = {
        "items": (int, "rows of the item and history tables"),
        "users": (int, "rows of the user table"),
        "delta_sizes": (str, "rows per delta, comma separated"),
        "repeats": (positive_int, "deltas per series and size"),
        "requests": (positive_int, "measured HTTP requests per arm and batch"),
        "rounds": (positive_int, "alternating blocks those requests are sent in"),
        "warmup": (int, "HTTP requests per arm and batch before measuring"),
    }
    for name, (kind, text) in sized.items():
        full, quick = SIZES[name]
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=kind, help=f"{text} (default {full}; --quick {quick})")
    parser.add_argument("--categories", type=positive_int, default=1_000)
    parser.add_argument("--dim", type=positive_int, default=64)
    parser.add_argument("--hidden", type=positive_int, default=128, help="MLP width")
    parser.add_argument("--codecs", default="int4", help="comma separated, e.g. int4,fp32")
    parser.add_argument("--batches", default="1,64", help="examples per request, comma separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=900.0, help="abort after this long")
