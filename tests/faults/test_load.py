"""Sustained predict load on loopback while a real trainer publishes a version every second.

The load starts once the resumed trainer's first version is served and lasts for at least
REQUESTS requests from CLIENTS threads and until MIN_VERSIONS versions have been served, at most
DURATION_S: zero failed requests, every response names exactly one version (a committed one,
never going back for one client), at least MIN_VERSIONS versions served (so versions were
applied during the load), p50/p99 printed. Then: neither the S3 secret nor the admin token
appears in any log, in /v1/model or in /metrics.
"""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np

from publisher.read.catalog import Catalog
from publisher.store import open_store

from .conftest import (
    ADMIN_TOKEN,
    PrivateServices,
    Processes,
    examples_for,
    kafka_url,
    s3_url,
    train_args,
)

CLIENTS = 3
REQUESTS = 3000
MIN_VERSIONS = 3
DURATION_S = 60.0
BATCH = 16


def test_predict_load_while_deltas_apply(
    private_services: PrivateServices, procs: Processes, unique_name: str, s3_env: None
) -> None:
    model, store_url = "load", s3_url(unique_name)
    bus = kafka_url(private_services, unique_name)
    first = procs.run(train_args(store_url, model, bus=bus, max_samples=2048, codec="int8"), "t0")
    assert first.returncode == 0, first.stderr[-3000:]
    server = procs.server(store_url, model, "server", bus=bus, poll_head_after="5")
    server.wait_ready()
    v0 = server.info()["version"]
    examples = examples_for(server.info()["features"], BATCH)
    # A delta every second for longer than the load lasts.
    trainer = procs.spawn(
        train_args(
            store_url,
            model,
            bus=bus,
            codec="int8",
            max_samples=2_000_000,
            resume=True,
            extra=["--interval-seconds", "1"],
        ),
        "trainer",
    )
    # The trainer starts (imports, restore, first delta) at its own pace on a loaded machine:
    # the load begins once it publishes, so the deltas apply during it, not before it.
    server.wait_version(v0 + 1, timeout_s=120)
    latencies: list[float] = []
    versions: list[list[int]] = [[] for _ in range(CLIENTS)]
    seen: set[int] = set()
    failures: list[str] = []
    lock = threading.Lock()
    issued = 0
    deadline = time.monotonic() + DURATION_S

    def client(i: int) -> None:
        nonlocal issued
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as http:
            while time.monotonic() < deadline:
                with lock:
                    if issued >= REQUESTS and len(seen) >= MIN_VERSIONS:
                        return
                    issued += 1
                started = time.perf_counter()
                try:
                    r = http.post("/v1/predict", json={"examples": examples})
                    body = r.json()
                except (httpx.HTTPError, ValueError) as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                elapsed = time.perf_counter() - started
                if r.status_code != 200 or not isinstance(body.get("version"), int):
                    failures.append(f"{r.status_code}: {r.text[:200]}")
                    continue
                if len(body["scores"]) != BATCH:
                    failures.append(f"{len(body['scores'])} scores for {BATCH} examples")
                with lock:
                    latencies.append(elapsed)
                    seen.add(body["version"])
                versions[i].append(body["version"])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=DURATION_S + 60)
    wall = time.monotonic() - started
    trainer.terminate()  # SIGTERM: checkpoint and exit, as in production
    assert procs.finish(trainer, "trainer", timeout=120).returncode == 0

    assert failures == []
    with open_store(store_url) as store:
        committed = {r.version for r in Catalog(store, model).versions()}
    served = {v for per_client in versions for v in per_client}
    assert served <= committed
    # One server: a client's later request never sees an older version.
    assert all(vs == sorted(vs) for vs in versions)
    assert len(served) >= MIN_VERSIONS, f"only versions {served} served during the load"
    ms = np.array(latencies) * 1000
    p50, p99 = np.percentile(ms, 50), np.percentile(ms, 99)
    print(
        f"RELIABILITY load: {len(latencies)} requests x {BATCH} examples from {CLIENTS} clients "
        f"in {wall:.1f} s, 0 failed, {len(served)} versions served during the load, "
        f"p50 {p50:.1f} ms p99 {p99:.1f} ms max {ms.max():.1f} ms"
    )

    # Credentials: nowhere in what the processes logged or what the server answers.
    secrets = [private_services.env["CHECKNRUN_S3_SECRET_KEY"], ADMIN_TOKEN]
    texts = {
        "server log": server.log.read_text(errors="replace"),
        "trainer log": (procs.tmp / "trainer.err").read_text(errors="replace"),
        "/v1/model": server.client.get("/v1/model").text,
        "/metrics": server.metrics(),
    }
    for where, text in texts.items():
        for secret in secrets:
            assert secret not in text, f"a credential appears in the {where}"
