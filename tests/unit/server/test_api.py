"""The REST API over real HTTP: create_app under uvicorn on a loopback port, httpx as client.

A synthetic trainer publishes real versions into a FileStore and announces them on a file bus;
the server follows. Covers bootstrap and readiness, following, gap fill, duplicates, pin/unpin
with and without a token, every 4xx path of /v1/predict, metrics, and that no secret leaks.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI

from bench.synthetic_run import SyntheticRun, model_scores, random_examples, small_config
from publisher.bus import open_announcer
from publisher.served_loss import ScoredBatch
from publisher.store import FileStore
from schemas.announcement import Announcement
from server.app import create_app
from server.settings import ServerSettings
from tests.support import wait_for

with warnings.catch_warnings():  # starlette's notice about its httpx-based client
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

TOKEN = "t0k3n-for-tests-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def messages_received(s: Served) -> int:
    """Announcement messages the server's follower has taken from the bus so far."""
    follower = s.app.state.server.subscriber.follower
    assert follower is not None, "the lifespan has not run"
    return int(follower.stats.received)


@dataclass
class Served:
    """A running server and the trainer feeding it."""

    client: httpx.Client
    app: FastAPI
    run: SyntheticRun
    root: Path

    def publish(self, kind: str = "delta", *, announce: bool = True, **kw: Any) -> int:
        return self.run.train_and_publish(kind, announce=announce, **kw)  # type: ignore[arg-type]

    def version(self) -> int | None:
        r = self.client.get("/v1/model")
        return r.json()["version"] if r.status_code == 200 else None

    def wait_version(self, version: int, timeout: float = 10.0) -> None:
        wait_for(lambda: self.version() == version, timeout, f"version {version}")


class ServerFactory:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.store = FileStore(tmp_path / "store")
        self.bus_url = f"file://{tmp_path / 'bus.log'}"
        self._cleanups: list[Callable[[], None]] = []

    def trainer(self, **config: Any) -> SyntheticRun:
        announcer = open_announcer(self.bus_url, "m")
        run = SyntheticRun(self.store, "m", small_config(**config), announce=announcer.announce)
        self._cleanups.append(run.close)
        return run

    def settings(self, **overrides: Any) -> ServerSettings:
        base: dict[str, Any] = dict(
            store=f"file://{self.tmp_path / 'store'}",
            bus=self.bus_url,
            model="m",
            poll_timeout_s=0.05,
            poll_head_after_s=0.5,
            retry_initial_s=0.05,
            retry_max_s=0.2,
            max_batch=16,
            max_body_bytes=64 * 1024,
        )
        base.update(overrides)
        return ServerSettings(**base)

    def start(self, run: SyntheticRun, **overrides: Any) -> Served:
        app = create_app(self.settings(**overrides))
        # h11, whatever else is installed (ray[serve] brings httptools, which uvicorn would
        # pick): the tests of made-up methods need a parser that lets them reach the app.
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", http="h11")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        wait_for(lambda: server.started, 30, "uvicorn")
        port = server.servers[0].sockets[0].getsockname()[1]
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)

        def stop() -> None:
            client.close()
            server.should_exit = True
            thread.join(timeout=10)

        self._cleanups.append(stop)
        return Served(client, app, run, self.tmp_path / "store")

    def close(self) -> None:
        for cleanup in reversed(self._cleanups):
            cleanup()


@pytest.fixture
def factory(tmp_path: Path) -> Iterator[ServerFactory]:
    f = ServerFactory(tmp_path)
    yield f
    f.close()


@pytest.fixture
def served(factory: ServerFactory) -> Served:
    """A server that bootstrapped v2 (full + delta) and has an admin token."""
    run = factory.trainer()
    run.train(2)
    run.publish("full")
    run.train(2)
    run.publish()
    s = factory.start(run, admin_token=TOKEN)
    s.wait_version(2)
    return s


def examples(s: Served, n: int = 4, seed: int = 0) -> list[dict[str, Any]]:
    return random_examples(s.run.config, n, seed)


# --- bootstrap, readiness, info ------------------------------------------------------------------


def test_not_ready_until_the_first_version(factory: ServerFactory) -> None:
    run = factory.trainer()
    s = factory.start(run)
    assert s.client.get("/healthz").json() == {"status": "ok"}
    ready = s.client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["reason"] == "bootstrapping"
    assert s.client.get("/v1/model").status_code == 503
    r = s.client.post("/v1/predict", json={"examples": random_examples(run.config, 1)})
    assert r.status_code == 503
    s.publish("full")
    wait_for(lambda: s.client.get("/readyz").status_code == 200, what="ready")
    assert s.client.get("/readyz").json()["version"] == 1


def test_model_info(served: Served) -> None:
    info = served.client.get("/v1/model").json()
    head = served.run.published[-1].manifest
    assert info["model"] == "m" and info["version"] == 2 and info["parent"] == 1
    assert info["kind"] == "delta" and info["baseline"] == 1 and info["applies_to"] == 1
    assert info["trainer_step"] == head.position.step
    assert info["created_at"].startswith(head.created_at.isoformat()[:19])
    assert info["applied_at"] >= info["created_at"]
    assert info["staleness_s"] == 0.0 and info["age_s"] >= 0
    assert info["versions_applied"] == 2 and info["bytes_fetched"] > 0
    assert info["pinned"] is False and info["pinned_version"] is None
    assert info["consistency"] == "double-buffer"
    kinds = {f["name"]: f["kind"] for f in info["features"]}
    assert kinds == {"d0": "dense", "d1": "dense", "f0": "sparse", "f1": "sparse", "tags": "bag"}
    assert info["id_space"] is None  # the client sends encoded ids
    assert info["served_loss"] is None and info["codecs"] == [served.run.codec]  # not measured


def test_model_info_shows_the_served_loss_its_trainer_measured(factory: ServerFactory) -> None:
    run = factory.trainer()
    run.publisher.served.measure_served_loss = True
    rng = np.random.default_rng(0)
    n = 400
    scored = ScoredBatch(
        dense=rng.normal(size=(n, len(run.config.dense))).astype(np.float32),
        sparse={
            f.name: (rng.integers(0, f.rows, n), np.arange(n, dtype=np.int64))
            for f in run.config.sparse
        },
        labels=(rng.random(n) < 0.5).astype(np.float32),
    )
    run.train(2)
    result = run.publisher.publish(replace(run.snapshot("full"), scored=(scored,)))
    loss = result.manifest.served_loss
    assert loss is not None and loss.samples == n
    s = factory.start(run)
    s.wait_version(1)
    info = s.client.get("/v1/model").json()
    assert info["served_loss"] == loss.model_dump() and info["codecs"] == [run.codec]


def test_openapi_documents_the_api(served: Served) -> None:
    spec = served.client.get("/openapi.json").json()
    paths = spec["paths"]
    for path in (
        "/v1/predict",
        "/v1/model",
        "/v1/model/pin",
        "/v1/model/unpin",
        "/v1/model/digest",
        "/healthz",
        "/readyz",
        "/metrics",
    ):
        assert path in paths, path
    schemas = spec["components"]["schemas"]
    for name in ("PredictRequest", "PredictResponse", "ModelInfo", "PinRequest"):
        assert name in schemas
    assert {"413", "422", "503"} <= set(paths["/v1/predict"]["post"]["responses"])
    assert "HTTPBearer" in spec["components"]["securitySchemes"]


def test_test_client_runs_the_lifespan(factory: ServerFactory) -> None:
    run = factory.trainer()
    run.publish("full")
    with TestClient(create_app(factory.settings())) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200, what="ready")
        assert client.get("/v1/model").json()["version"] == 1


# --- following -----------------------------------------------------------------------------------


def test_follows_announced_versions_and_scores_match_the_trainer(served: Served) -> None:
    v3 = served.publish()
    served.wait_version(v3)
    batch = examples(served, 8)
    r = served.client.post("/v1/predict", json={"examples": batch})
    assert r.status_code == 200
    body = r.json()
    # no `unknown_ids`: encoded ids; the track every answer names
    assert set(body) == {"model", "version", "track", "scores"} and body["track"] == "released"
    assert body["model"] == "m" and body["version"] == v3
    np.testing.assert_allclose(body["scores"], model_scores(served.run.model, batch), atol=1e-6)


def test_model_info_says_where_the_last_apply_went(served: Served) -> None:
    v3 = served.publish()
    served.wait_version(v3)
    info = served.client.get("/v1/model").json()
    last = info["last_apply"]
    assert last["versions"] == [v3]
    stamps = (info["created_at"], last["heard_at"], info["applied_at"])
    created, heard, applied = (datetime.fromisoformat(t) for t in stamps)
    assert created <= heard <= applied
    spans = ("plan_s", "queue_s", "fetch_s", "write_s", "level_s")
    assert all(last[k] >= 0 for k in spans) and last["fetch_s"] > 0


def test_gap_fill_and_duplicate_announcements(served: Served, factory: ServerFactory) -> None:
    v3 = served.publish(announce=False)
    v4 = served.publish()
    served.wait_version(v4)
    applied = served.client.get("/v1/model").json()["versions_applied"]
    assert applied == 4  # v3 came from the store, not the bus
    received = messages_received(served)
    announcer = open_announcer(factory.bus_url, "m")
    for ref in served.run.published:
        announcer.announce(Announcement.of(ref.manifest, ref.ref.key))  # all again, old first
    sent = len(served.run.published)
    wait_for(lambda: messages_received(served) >= received + sent, what="redelivery")
    info = served.client.get("/v1/model").json()
    assert info["version"] == v4 and info["versions_applied"] == applied
    assert v3 < v4


def test_corrupt_delta_is_rejected_and_readiness_reflects_staleness(
    factory: ServerFactory,
) -> None:
    run = factory.trainer()
    run.publish("full")
    # No HEAD polls: they could apply v2 between its commit and its corruption below.
    s = factory.start(run, ready_max_staleness_s=0.3, admin_token=TOKEN, poll_head_after_s=600)
    s.wait_version(1)
    s.run.publisher.announce = None  # write v2, corrupt it, then announce it
    v2 = s.publish()
    ref = s.run.published[-1].ref
    blob = s.root / ref.manifest.tables[0].blob.key
    blob.write_bytes(b"\0" * blob.stat().st_size)
    open_announcer(factory.bus_url, "m").announce(Announcement.of(ref.manifest, ref.key))

    wait_for(lambda: s.client.get("/v1/model").json()["rejected_versions"] >= 1, what="reject")
    r = s.client.post("/v1/predict", json={"examples": examples(s)})
    assert r.status_code == 200 and r.json()["version"] == 1
    wait_for(lambda: s.client.get("/readyz").status_code == 503, what="stale")
    assert "waited" in s.client.get("/readyz").json()["reason"]
    assert s.client.get("/v1/model").json()["latest_known_version"] == v2
    text = s.client.get("/metrics").text
    assert 'checknrun_server_rejected_versions_total{reason="integrity"}' in text
    # Pinned on purpose: stale is expected, so still ready.
    assert s.client.post("/v1/model/pin", json={"version": 1}, headers=AUTH).status_code == 200
    assert s.client.get("/readyz").status_code == 200


# --- admin ---------------------------------------------------------------------------------------


def test_admin_endpoints_are_disabled_without_a_token(factory: ServerFactory) -> None:
    run = factory.trainer()
    run.publish("full")
    s = factory.start(run)
    s.wait_version(1)
    for method, path in (
        ("post", "/v1/model/pin"),
        ("post", "/v1/model/unpin"),
        ("get", "/v1/model/digest"),
    ):
        r = s.client.request(method, path, json={"version": 1}, headers=AUTH)
        assert r.status_code == 404, path
        assert "disabled" in r.json()["detail"]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token-0123456789"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": "Bearer"},
    ],
    ids=["missing", "wrong", "wrong-scheme", "empty"],
)
def test_admin_endpoints_need_the_bearer_token(served: Served, headers: dict[str, str]) -> None:
    for method, path in (
        ("post", "/v1/model/pin"),
        ("post", "/v1/model/unpin"),
        ("get", "/v1/model/digest"),
    ):
        r = served.client.request(method, path, json={"version": 1}, headers=headers)
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
    assert served.version() == 2


def test_pin_then_unpin(served: Served) -> None:
    r = served.client.post("/v1/model/pin", json={"version": 1}, headers=AUTH)
    assert r.status_code == 200
    assert r.json()["version"] == 1 and r.json()["pinned"] is True
    assert r.json()["pinned_version"] == 1
    assert (
        served.client.post("/v1/predict", json={"examples": examples(served)}).json()["version"]
        == 1
    )
    v3 = served.publish()
    wait_for(
        lambda: served.client.get("/v1/model").json()["latest_known_version"] == v3,
        what="v3 announced",
    )
    assert served.client.get("/v1/model").json()["version"] == 1  # pinned: not applied
    r = served.client.post("/v1/model/unpin", headers=AUTH)
    assert r.status_code == 200 and r.json()["was_pinned"] is True
    served.wait_version(v3)
    assert served.client.get("/v1/model").json()["pinned"] is False
    assert served.client.post("/v1/model/unpin", headers=AUTH).json()["was_pinned"] is False


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"version": 99}, 404),
        ({"version": "1"}, 422),
        ({"version": 0}, 422),
        ({}, 422),
        ({"version": 1, "extra": True}, 422),
    ],
)
def test_pin_errors(served: Served, body: dict[str, Any], status: int) -> None:
    r = served.client.post("/v1/model/pin", json=body, headers=AUTH)
    assert r.status_code == status, r.text
    assert served.client.get("/v1/model").json()["pinned"] is False


def test_pin_of_a_corrupt_version_is_502_and_changes_nothing(served: Served) -> None:
    blob = served.root / served.run.published[0].manifest.tables[0].blob.key
    blob.write_bytes(b"\0" * blob.stat().st_size)
    r = served.client.post("/v1/model/pin", json={"version": 1}, headers=AUTH)
    assert r.status_code == 502 and "IntegrityError" in r.json()["detail"]
    info = served.client.get("/v1/model").json()
    assert info["version"] == 2 and info["pinned"] is False
    assert served.client.post("/v1/predict", json={"examples": examples(served)}).is_success


def test_digest_matches_between_replicas(served: Served, factory: ServerFactory) -> None:
    other = factory.start(served.run, admin_token=TOKEN, consistency="rwlock")
    other.wait_version(2)
    a = served.client.get("/v1/model/digest", headers=AUTH).json()
    b = other.client.get("/v1/model/digest", headers=AUTH).json()
    assert a["version"] == b["version"] == 2
    assert a["tensors"] == b["tensors"] and "embeddings.f0" in a["tensors"]


# --- predict validation --------------------------------------------------------------------------


def _example(**changes: Any) -> dict[str, Any]:
    ex: dict[str, Any] = {"d0": 0.5, "d1": -1, "f0": 3, "f1": 4, "tags": [1, 2]}
    for k, v in changes.items():
        if v is _DROP:
            del ex[k]
        else:
            ex[k] = v
    return ex


_DROP = object()


@pytest.mark.parametrize(
    ("example", "feature", "kind"),
    [
        (_example(colour=3), "colour", "unknown_feature"),
        (_example(f1=_DROP), "f1", "missing_feature"),
        (_example(f0=1000), "f0", "id_out_of_range"),
        (_example(f0=-1), "f0", "id_out_of_range"),
        (_example(tags=[1, 20]), "tags", "id_out_of_range"),
        (_example(f0=[1, 2]), "f0", "wrong_type"),
        (_example(f0=1.5), "f0", "wrong_type"),
        (_example(tags=3), "tags", "wrong_type"),
        (_example(d0=[1]), "d0", "wrong_type"),
    ],
)
def test_predict_rejects_invalid_features(
    served: Served, example: dict[str, Any], feature: str, kind: str
) -> None:
    r = served.client.post("/v1/predict", json={"examples": [_example(), example]})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert detail[0]["loc"] == ["body", "examples", 1, feature]
    assert detail[0]["type"] == kind
    assert feature in detail[0]["msg"]


@pytest.mark.parametrize(
    "raw",
    [
        b'{"examples": [{"d0": "x", "d1": 1, "f0": 1, "f1": 1, "tags": []}]}',  # string
        b'{"examples": [{"d0": true, "d1": 1, "f0": 1, "f1": 1, "tags": []}]}',  # bool
        b'{"examples": []}',  # empty batch
        b'{"examples": [], "extra": 1}',  # unknown top-level field
        b'{"rows": []}',  # missing examples
        b'{"examples": [{"d0": 1, "d1": 1, "f0": 1, "f1": 1, "tags": [true]}]}',
        b"not json",
    ],
)
def test_predict_rejects_malformed_bodies(served: Served, raw: bytes) -> None:
    r = served.client.post("/v1/predict", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text


def test_predict_rejects_non_finite_numbers(served: Served) -> None:
    raw = b'{"examples": [{"d0": NaN, "d1": 1, "f0": 1, "f1": 1, "tags": []}]}'
    r = served.client.post("/v1/predict", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 422


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/v1/predict", b'{"examples": [{"\\ud800": 1}]}'),  # a lone surrogate as a name
        ("/v1/predict", b'{"examples": [{"d0": "\\udfff", "d1": 1, "f0": 1, "f1": 1}]}'),
        ("/v1/predict", b'{"examples": [{"d0": 1}], "\\ud800": 1}'),
        ("/v1/model/pin", b'{"version": 1, "\\ud800": "\\ud800"}'),
    ],
)
def test_lone_surrogates_are_a_short_4xx(served: Served, path: str, raw: bytes) -> None:
    headers = {"Content-Type": "application/json", **AUTH}
    r = served.client.post(path, content=raw, headers=headers)
    assert r.status_code == 422, r.text
    assert len(r.content) < 4096 and isinstance(r.json()["detail"], list)


@pytest.mark.parametrize(
    "body",
    [
        {"examples": [{f"k{i}": "x" for i in range(3000)}]},  # wrong types and unknown names
        {"examples": [[i] for i in range(5000)]},  # not objects (and above the batch cap)
        {"examples": [_example()], **{f"k{i}": 1 for i in range(5000)}},  # unknown fields
    ],
)
def test_a_body_full_of_mistakes_gets_a_capped_report(served: Served, body: object) -> None:
    raw = json.dumps(body).encode()
    assert len(raw) < 64 * 1024  # under the body cap: parsed and validated
    r = served.client.post("/v1/predict", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code in (413, 422), r.text
    assert len(r.content) < 16 * 1024, len(r.content)
    detail = r.json()["detail"]
    assert isinstance(detail, str) or len(detail) <= 51


def test_an_example_without_a_finite_score_is_a_422_never_null(served: Served) -> None:
    # Finite weights, finite inputs, yet 3e38 - 3e38 overflows float32 inside the model: NaN.
    overflowing = _example(d0=3e38, d1=-3e38)
    r = served.client.post("/v1/predict", json={"examples": [_example(), overflowing]})
    assert r.status_code == 422, r.text
    (problem,) = r.json()["detail"]
    assert problem["loc"] == ["body", "examples", 1] and problem["type"] == "score_not_finite"
    assert served.client.post("/v1/predict", json={"examples": [_example()]}).is_success


def test_batch_above_the_cap_is_413(served: Served) -> None:
    r = served.client.post("/v1/predict", json={"examples": [_example()] * 17})
    assert r.status_code == 413 and "16" in r.json()["detail"]
    assert served.client.post("/v1/predict", json={"examples": [_example()] * 16}).is_success


def test_body_above_the_cap_is_413_declared_or_streamed(served: Served) -> None:
    big = json.dumps({"examples": [_example(tags=list(range(10)) * 3000)]}).encode()
    assert len(big) > 64 * 1024
    r = served.client.post("/v1/predict", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "Content-Length" not in r.text

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer encoding
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    r = served.client.post(
        "/v1/predict", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413
    assert served.client.get("/healthz").status_code == 200


def test_hashing_model_folds_ids_in(factory: ServerFactory) -> None:
    run = factory.trainer(hashing=True)
    run.publish("full")
    s = factory.start(run)
    s.wait_version(1)
    assert s.client.get("/v1/model").json()["hashing"] is True
    far = _example(f0=10**12 + 3, f1=-7, tags=[25, -1])
    near = _example(f0=(10**12 + 3) % 1000, f1=-7 % 500, tags=[25 % 20, -1 % 20])
    r = s.client.post("/v1/predict", json={"examples": [far, near]})
    assert r.status_code == 200, r.text
    a, b = r.json()["scores"]
    assert a == pytest.approx(b, abs=1e-7)
    r = s.client.post("/v1/predict", json={"examples": [_example(f0=2**70)]})
    assert r.status_code == 422


# --- metrics and secrets -------------------------------------------------------------------------


def test_metrics_exposition(served: Served) -> None:
    served.client.post("/v1/predict", json={"examples": examples(served)})
    served.client.post("/v1/predict", json={"examples": [_example(colour=1)]})
    r = served.client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = r.text.splitlines()
    for line in (
        # the served version's gauges and the predictions' series carry the server's track
        'checknrun_server_model_version{track="released"} 2.0',
        'checknrun_server_staleness_seconds{track="released"} 0.0',
        'checknrun_server_predict_seconds_bucket{le="+Inf",track="released"} 1.0',
        'checknrun_server_predict_seconds_count{track="released"} 1.0',
        # prometheus_client writes labels in name order.
        'checknrun_server_http_requests_total{method="POST",route="/v1/predict",status="200"} 1.0',
        'checknrun_server_http_requests_total{method="POST",route="/v1/predict",status="422"} 1.0',
        'checknrun_server_apply_seconds_count{kind="bootstrap"} 1.0',
        "# TYPE checknrun_server_apply_seconds histogram",
        "# TYPE checknrun_server_bytes_fetched_total counter",
        'checknrun_server_pinned{track="released"} 0.0',
        'checknrun_server_ready{track="released"} 1.0',
    ):
        assert line in lines, line


def _request_series(text: str) -> list[dict[str, str]]:
    prefix = "checknrun_server_http_requests_total{"
    series = []
    for line in text.splitlines():
        if line.startswith(prefix):
            labels = line[len(prefix) : line.index("}")]
            series.append(dict(pair.split("=", 1) for pair in labels.split(",")))
    return [{k: v.strip('"') for k, v in s.items()} for s in series]


def test_made_up_methods_and_paths_add_no_metric_series(served: Served) -> None:
    for i in range(300):
        served.client.request(f"M{i}", "/v1/predict")
        served.client.get(f"/made/up/{i}")
    for i in range(3):
        served.client.request(chr(ord("A") + i) * 8000, "/v1/model")
    text = served.client.get("/metrics").text
    series = _request_series(text)
    methods = {s["method"] for s in series}
    routes = {s["route"] for s in series}
    assert methods <= {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "other"}
    assert "other" in methods
    paths = {*served.client.get("/openapi.json").json()["paths"], "/openapi.json", "unmatched"}
    assert routes <= paths
    assert len(series) < 20 and len(text) < 32 * 1024, (len(series), len(text))
    other = [s for s in series if s["method"] == "other" and s["route"] == "/v1/predict"]
    assert other == [{"route": "/v1/predict", "method": "other", "status": "405"}]


def test_no_response_exposes_the_token_or_the_store(served: Served) -> None:
    texts = [
        served.client.get(p).text
        for p in ("/v1/model", "/openapi.json", "/metrics", "/readyz", "/docs")
    ]
    texts.append(served.client.post("/v1/model/pin", json={"version": 1}).text)
    texts.append(served.client.post("/v1/model/pin", json={"version": 99}, headers=AUTH).text)
    for text in texts:
        assert TOKEN not in text
        assert str(served.root) not in text
    settings = served.app.state.server.settings
    assert TOKEN not in repr(settings) and TOKEN not in str(settings.model_dump())
