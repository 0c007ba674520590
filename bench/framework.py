"""Part `framework`: a serving framework kept live. Ray Serve's predict latency, with and without
a version applying, side by side in one run.

    checknrun bench framework [--users 100000] [--items 200000] [--dim 64] [--delta-rows 20000]
                              [--publish-every-s 0.5] [--batches 1,64] [--requests 1000]
                              [--rounds 6] [--warmup 50] [--quick] [--json OUT]

The framework is Ray Serve (the `serve-ray` extra), on a local Ray started here: one replica of
examples/ray_serve_live.py's deployment (1 CPU, so torch on one thread, as `checknrun serve`
runs it) follows examples/two_tower.py through a file bus. The trainer is a child process
holding two such models, each with every row but the unknown row held by a raw id (`u<row>`,
`i<row>`) and its own `IncrementalCheckpointer` (consecutive policy, int4), store and bus: the
one the replica follows, and a decoy nobody follows. While told to, it publishes one of them: a
delta every `--publish-every-s` of `--delta-rows` rows of each id-mapped table (`user`, `item`,
with their id-map entries) edited in place and marked dirty.

Measured per batch size of `--batches`: sequential keep-alive POSTs from one httpx client to the
Ray Serve proxy (the same bodies of known ids for every arm), after a warm-up, in `--rounds`
blocks per arm, the order rotating each round:

- idle: the trainer paused and the replica at HEAD: nothing applies;
- trainer: the trainer publishing the decoy: its CPU and disk load on the machine, and no
  apply (the control: on a small machine the trainer's work alone moves the tail);
- applying: the trainer publishing the followed model; the replica fetches, verifies, decodes
  and swaps each delta in while it answers. The replica's own tally (`GET /model` `applies`)
  gives the versions it applied during the arm and the fraction of its time spent applying.

p50/p99 over every block; the ratios to idle are what to read (the machine is shared: the arms
ran interleaved on it), applying over trainer being what the apply itself costs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from bench.child_server import free_port
from bench.machine import describe_machine, log
from bench.predict_load import RequestSamples, percentiles, post_sequentially
from bench.serving import time_limit
from bench.two_tower_writer import MAPPED_TABLES, TwoTowerWriter
from examples import two_tower
from publisher.cli import positive_int

try:
    import ray
    from ray import serve

    from examples.ray_serve_live import LiveModelDeployment, replica_pythonpath
except ImportError as exc:  # the optional extra
    raise ImportError(
        f"bench framework needs Ray Serve ({exc}): pip install -c constraints.txt -e '.[serve-ray]'"
    ) from exc

#: option -> (default, --quick). Given options win.
SIZES: dict[str, tuple[Any, Any]] = {
    "users": (100_000, 5_000),
    "items": (200_000, 10_000),
    "delta_rows": (20_000, 1_000),
    "requests": (1_000, 60),
    "rounds": (6, 3),
    "warmup": (50, 5),
}
IDLE, TRAINER, APPLYING = "idle", "trainer", "applying"
ARMS = (IDLE, TRAINER, APPLYING)
MODEL = "two_tower"
#: distinct request bodies per batch size, sent in turn.
BODIES = 8
#: Ray's start, the replica's (imports torch, bootstraps the full version) on a loaded machine.
START_S = 180.0
#: the replica catching up with the trainer's last version once it pauses.
CATCH_UP_S = 60.0


# --- the trainer: a child process publishing deltas while told to --------------------------


def publisher_main(conn: Connection, options: dict[str, Any]) -> None:
    """The trainer process: a full version of each model, then deltas of one between each
    ("start", "live" or "decoy") and "pause".

    Sends ("ready", version) after the full versions; answers "pause" with ("paused",
    [[version, publish seconds], ...]) of the deltas since "start"; returns on "stop".
    """
    torch.set_num_threads(1)
    config = two_tower.TwoTowerConfig(**options["config"])
    writers = {
        which: TwoTowerWriter(
            options[which]["store"],
            MODEL,
            config,
            codec="int4",
            seed=options["seed"],
            bus=options[which]["bus"],
        )
        for which in ("live", "decoy")
    }
    try:
        writers["decoy"].publish(full=True)
        conn.send(("ready", writers["live"].publish(full=True)))
        while True:
            command = conn.recv()
            if command == "stop":
                return
            assert command[0] == "start", command
            writer = writers[command[1]]
            published: list[list[float]] = []
            while True:
                started = time.perf_counter()
                for table in MAPPED_TABLES:  # a delta: `delta_rows` rows of each
                    writer.touch_rows(table, options["delta_rows"])
                version = writer.publish()
                seconds = time.perf_counter() - started
                published.append([version, round(seconds, 4)])
                if conn.poll(max(options["every_s"] - seconds, 0.0)):
                    assert conn.recv() == "pause"
                    conn.send(("paused", published))
                    break
    finally:
        for writer in writers.values():
            writer.close()


class TrainerProcess:
    """The child trainer (`publisher_main`) and its commands."""

    def __init__(self, options: dict[str, Any]) -> None:
        context = multiprocessing.get_context("spawn")  # no forked torch or Ray state
        self.conn, child = context.Pipe()
        self.proc = context.Process(target=publisher_main, args=(child, options), daemon=True)
        self.proc.start()
        child.close()

    def _reply(self, timeout: float) -> tuple[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the trainer process did not answer in {timeout} s")
        reply: tuple[str, Any] = self.conn.recv()
        return reply

    def ready(self, timeout: float) -> int:
        """The full version's number, once committed."""
        kind, version = self._reply(timeout)
        assert kind == "ready", kind
        return int(version)

    def start(self, which: str) -> None:
        """Publish deltas of the "live" model (the followed one) or of the "decoy"."""
        self.conn.send(("start", which))

    def pause(self, timeout: float = CATCH_UP_S) -> list[list[float]]:
        """Stop publishing after the delta in progress: [version, publish s] of each delta."""
        self.conn.send("pause")
        kind, published = self._reply(timeout)
        assert kind == "paused", kind
        return list(published)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # the child is gone already
            self.conn.send("stop")
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


# --- Ray Serve ---------------------------------------------------------------------------


@contextlib.contextmanager
def ray_serve() -> Iterator[str]:
    """A local Ray (no dashboard, no usage stats, loopback) and Serve: the proxy's base URL."""
    env = {"RAY_USAGE_STATS_ENABLED": "0"}
    if "RAY_AUTH_TOKEN" not in os.environ and "RAY_AUTH_MODE" not in os.environ:
        # Ray's default token auth with the token in the environment: no ~/.ray/auth_token.
        env["RAY_AUTH_TOKEN"] = uuid.uuid4().hex
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # Short: Ray's unix sockets live under it (108 bytes at most).
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    port = free_port()
    sigterm = signal.getsignal(signal.SIGTERM)  # ray.init replaces it, and shutdown leaves it
    try:
        ray.init(
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=temp,
            _node_ip_address="127.0.0.1",
            runtime_env={"env_vars": {"PYTHONPATH": replica_pythonpath()}},
        )
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()  # type: ignore[no-untyped-call]
        finally:
            ray.shutdown()
            signal.signal(signal.SIGTERM, sigterm)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            shutil.rmtree(temp, ignore_errors=True)


def deploy(store: str, bus: str) -> None:
    """The live deployment of the two-tower model, one replica of 1 CPU."""
    app = LiveModelDeployment.options(ray_actor_options={"num_cpus": 1}).bind(
        store,
        MODEL,
        model_factory="examples.two_tower:build",
        request_adapter="examples.two_tower:requests",
        bus=bus,
        poll_head_after_s=1.0,
    )
    serve.run(app, name=MODEL, route_prefix="/")


def served_info(client: httpx.Client) -> dict[str, Any]:
    response = client.get("/model")
    response.raise_for_status()
    info: dict[str, Any] = response.json()
    return info


def wait_served(client: httpx.Client, version: int, timeout: float) -> dict[str, Any]:
    """The replica's info once it serves `version` or later; TimeoutError naming what it
    serves after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    info: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            info = served_info(client)
        except httpx.HTTPError as exc:
            info = {"error": f"{type(exc).__name__}: {exc}"}
        if (info.get("version") or 0) >= version:
            return info
        time.sleep(0.1)
    raise TimeoutError(f"the replica did not serve v{version} in {timeout} s: {info}")


# --- requests ----------------------------------------------------------------------------


def draw_bodies(config: two_tower.TwoTowerConfig, batch: int, seed: int) -> list[bytes]:
    """`BODIES` request bodies of `batch` examples of known users and items (rows >= 1)."""
    rng = np.random.default_rng(seed + batch)
    bodies = []
    for _ in range(BODIES):
        examples = [
            {
                "user": f"u{int(rng.integers(1, config.users))}",
                "item": f"i{int(rng.integers(1, config.items))}",
                "history": rng.integers(0, config.items, int(rng.integers(0, 4))).tolist(),
                "categories": rng.integers(0, config.categories, int(rng.integers(1, 3))).tolist(),
            }
            for _ in range(batch)
        ]
        bodies.append(json.dumps({"examples": examples}).encode())
    return bodies


@dataclass
class ArmSamples(RequestSamples):
    """One arm's requests at one batch size, and (applying) what the replica applied."""

    versions_seen: set[int] = field(default_factory=set)
    wall_s: float = 0.0
    versions_applied: int = 0
    apply_s: float = 0.0
    publish_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            **percentiles(self.latencies),
            "failed": self.failed,
            "first_error": self.first_error,
            "versions_answered": len(self.versions_seen),
        }
        if self.publish_s:
            out.update(
                versions_published=len(self.publish_s),
                publish_ms_median=round(1000 * float(np.median(self.publish_s)), 2),
            )
        if self.wall_s:
            out.update(
                versions_applied=self.versions_applied,
                apply_busy_fraction=round(self.apply_s / self.wall_s, 3),
                apply_ms_mean=round(1000 * self.apply_s / max(self.versions_applied, 1), 2),
            )
        return out


def post(client: httpx.Client, bodies: Sequence[bytes], n: int, into: ArmSamples) -> None:
    """`n` sequential POSTs to the replica, the versions that answered noted."""
    post_sequentially(
        client, "/", bodies, n, into, lambda r: into.versions_seen.add(int(r.json()["version"]))
    )


def rotating(arms: Sequence[str], rounds: int) -> Iterator[str]:
    """Every arm `rounds` times, the order rotating each round (ABC BCA CAB...)."""
    for r in range(rounds):
        turn = r % len(arms)
        yield from (*arms[turn:], *arms[:turn])


def measure_batch(
    client: httpx.Client, trainer: TrainerProcess, bodies: Sequence[bytes], options: dict[str, Any]
) -> dict[str, ArmSamples]:
    """Every arm at one batch size, in rotating blocks; the trainer paused between them."""
    post(client, bodies, options["warmup"], ArmSamples())
    per_block = max(options["requests"] // options["rounds"], 1)
    samples = {arm: ArmSamples() for arm in ARMS}
    for arm in rotating(ARMS, options["rounds"]):
        into = samples[arm]
        if arm == IDLE:
            post(client, bodies, per_block, into)
            continue
        if arm == TRAINER:
            trainer.start("decoy")
            post(client, bodies, per_block, into)
            into.publish_s += [seconds for _, seconds in trainer.pause()]
            continue
        before = served_info(client)["applies"]
        started = time.perf_counter()
        trainer.start("live")
        post(client, bodies, per_block, into)
        into.wall_s += time.perf_counter() - started
        after = served_info(client)["applies"]
        into.versions_applied += after["versions"] - before["versions"]
        into.apply_s += after["seconds"] - before["seconds"]
        published = trainer.pause()
        into.publish_s += [seconds for _, seconds in published]
        # The idle arm must find nothing left to apply.
        wait_served(client, int(published[-1][0]), CATCH_UP_S)
    return samples


# --- the part ----------------------------------------------------------------------------


def run(
    quick: bool,
    *,
    users: int | None = None,
    items: int | None = None,
    categories: int = 1_000,
    dim: int = 64,
    hidden: int = 128,
    delta_rows: int | None = None,
    publish_every_s: float = 0.5,
    batches: str = "1,64",
    requests: int | None = None,
    rounds: int | None = None,
    warmup: int | None = None,
    seed: int = 0,
    max_seconds: float = 900.0,
) -> dict[str, Any]:
    """Every arm at every batch size; prints the table and returns the document."""
    given = {
        "users": users,
        "items": items,
        "delta_rows": delta_rows,
        "requests": requests,
        "rounds": rounds,
        "warmup": warmup,
    }
    options: dict[str, Any] = {
        k: (v if v is not None else SIZES[k][1 if quick else 0]) for k, v in given.items()
    }
    if options["delta_rows"] > min(options["users"], options["items"]):
        raise ValueError(f"deltas of {options['delta_rows']:,} rows exceed a table's rows")
    config = two_tower.TwoTowerConfig(
        users=options["users"],
        items=options["items"],
        categories=categories,
        dim=dim,
        hidden=hidden,
    )
    sizes = [int(b) for b in batches.split(",")]
    options.update(every_s=publish_every_s, seed=seed)
    machine = describe_machine()
    workdir = Path(tempfile.mkdtemp(prefix="cnr-framework-"))
    where = {
        which: {
            "store": f"file://{workdir / which / 'store'}",
            "bus": f"file://{workdir / which / 'announcements.log'}",
        }
        for which in ("live", "decoy")
    }
    results: dict[str, dict[str, Any]] = {}
    try:
        with time_limit(max_seconds), ray_serve() as proxy:
            log(f"framework: trainer publishing v1 ({config.users:,} + {config.items:,} rows)")
            trainer = TrainerProcess(
                {
                    **where,
                    "config": {k: v for k, v in config.to_json().items() if k != "architecture"},
                    "delta_rows": options["delta_rows"],
                    "every_s": publish_every_s,
                    "seed": seed,
                }
            )
            try:
                first = trainer.ready(START_S)
                started = time.perf_counter()
                deploy(where["live"]["store"], where["live"]["bus"])
                with httpx.Client(base_url=proxy, timeout=60.0) as client:
                    wait_served(client, first, START_S)
                    log(
                        f"framework: replica serving v{first} {time.perf_counter() - started:.1f} s"
                    )
                    for batch in sizes:
                        log(f"framework: batch {batch}, {options['requests']} requests per arm")
                        bodies = draw_bodies(config, batch, seed)
                        arms = measure_batch(client, trainer, bodies, options)
                        results[str(batch)] = {arm: s.summary() for arm, s in arms.items()}
                    served = served_info(client)
            finally:
                trainer.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    doc = {
        "part": "framework",
        "framework": {"name": "ray[serve]", "version": ray.__version__},
        "config": {
            **options,
            "batches": sizes,
            "model": config.to_json(),
            "codec": "int4",
            "policy": "consecutive",
            "tables_per_delta": list(MAPPED_TABLES),
            "replicas": 1,
            "replica_cpus": 1,
            "consistency": "double-buffer",
        },
        "batches": results,
        "over_idle": ratios(results),
        "served": served,
        "quick": quick,
        "machine": machine,
        "load_average_end": describe_machine()["load_average"],
    }
    print_table(doc)
    return doc


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per batch and arm but idle: its p50 and p99 over idle's."""

    def ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
        return round(a[key] / b[key], 3) if a.get(key) and b.get(key) else None

    return {
        batch: {
            arm: {q: ratio(r[arm], r[IDLE], f"{q}_ms") for q in ("p50", "p99")}
            for arm in (TRAINER, APPLYING)
        }
        for batch, r in results.items()
    }


def print_table(doc: dict[str, Any]) -> None:
    c = doc["config"]
    m = c["model"]
    print(
        f"\nframework: Ray Serve {doc['framework']['version']}, examples.two_tower "
        f"({m['users']:,} users, {m['items']:,} items x {m['dim']}, int4); deltas of "
        f"{c['delta_rows']:,} rows of user and item every {c['every_s']} s; "
        f"sequential keep-alive POSTs"
    )
    print(
        f"{'batch':>5} {'arm':<13} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'n':>5} "
        f"{'failed':>6} {'applied':>7} {'busy':>5} {'apply ms':>8}"
    )
    for batch, r in doc["batches"].items():
        for arm in ARMS:
            x = r[arm]
            print(
                f"{batch:>5} {arm:<13} {x.get('p50_ms', '-'):>8} {x.get('p99_ms', '-'):>8} "
                f"{x.get('max_ms', '-'):>8} {x['n']:>5} {x['failed']:>6} "
                f"{x.get('versions_applied', '-'):>7} {x.get('apply_busy_fraction', '-'):>5} "
                f"{x.get('apply_ms_mean', '-'):>8}"
            )
        for arm, q in doc["over_idle"][batch].items():
            label = f"{arm}/idle"
            print(f"{batch:>5} {label:<13} {q['p50'] or '-':>8} {q['p99'] or '-':>8}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Sizes (unset: SIZES' full or --quick value), the model, the trainer's cadence."""
    sized: dict[str, tuple[Callable[[str], int], str]] = {
        "users": (positive_int, "rows of the user table"),
        "items": (positive_int, "rows of the item and history tables"),
        "delta_rows": (positive_int, "rows of user and of item each delta changes"),
        "requests": (positive_int, "measured requests per arm and batch"),
        "rounds": (positive_int, "alternating blocks those requests are sent in"),
        "warmup": (int, "requests per batch before measuring"),
    }
    for name, (kind, text) in sized.items():
        full, quick = SIZES[name]
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=kind, help=f"{text} (default {full}; --quick {quick})")
    parser.add_argument("--categories", type=positive_int, default=1_000)
    parser.add_argument("--dim", type=positive_int, default=64)
    parser.add_argument("--hidden", type=positive_int, default=128, help="MLP width")
    parser.add_argument(
        "--publish-every-s", type=float, default=0.5, help="the trainer's cadence while applying"
    )
    parser.add_argument("--batches", default="1,64", help="examples per request, comma separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=900.0, help="abort after this long")
