"""The REST API of a model trained from raw events: predict with raw ids (unknown ids counted in
the response and the metrics), GET /v1/model showing the id space, every 4xx of a raw example,
and the OpenAPI document saying so. The versions are written by the real IncrementalCheckpointer
with its id maps (bench/synthetic_live.py) and announced on a file bus the server follows."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.synthetic_live import LIVE_SPEC, SyntheticLiveRun
from publisher.live_features import DenseFeature
from publisher.store import FileStore
from server.app import create_app
from server.settings import ServerSettings
from tests.support import wait_for

with warnings.catch_warnings():  # starlette's notice about its httpx-based client
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

TS = 1_700_000_000.0
#: the synthetic live model with a dense feature: requests send `price` (or leave it out).
SPEC = replace(LIVE_SPEC, dense_features=(DenseFeature("price"),))


@dataclass
class RawServed:
    client: TestClient
    run: SyntheticLiveRun

    def version(self) -> int | None:
        r = self.client.get("/v1/model")
        return r.json()["version"] if r.status_code == 200 else None

    @property
    def grpc_port(self) -> int:
        port: int = self.client.app.state.server.grpc_port  # type: ignore[attr-defined]
        return port

    def predict(self, *examples: dict[str, Any]) -> Any:
        return self.client.post("/v1/predict", json={"examples": list(examples)})


def train(run: SyntheticLiveRun, users: list[str], ts: float = TS) -> None:
    run.train(
        [
            {"user": u, "item": i % 4, "genres": ["Drama", "Noir"][: i % 3], "ts": ts + i}
            | {"label": i % 2}
            | ({"price": 10.0 * i} if i % 3 else {})
            for i, u in enumerate(users)
        ]
    )


@pytest.fixture
def served(tmp_path: Path) -> Iterator[RawServed]:
    bus = f"file://{tmp_path / 'bus.log'}"
    run = SyntheticLiveRun(FileStore(tmp_path / "store"), "m", spec=SPEC, bus=bus)
    train(run, [f"u{i}" for i in range(10)])
    run.publish()
    settings = ServerSettings(
        store=f"file://{tmp_path / 'store'}",
        bus=bus,
        model="m",
        bus_start="earliest",
        poll_timeout_s=0.05,
        poll_head_after_s=0.5,
        retry_initial_s=0.05,
        retry_max_s=0.2,
        max_batch=16,
        max_body_bytes=64 * 1024,
        grpc_port=0,  # the v2 protocol over gRPC too (tests/unit/server/test_v2_protocol.py)
    )
    try:
        with TestClient(create_app(settings)) as client:
            s = RawServed(client, run)
            wait_for(lambda: s.version() == 1, what="version 1")
            yield s
    finally:
        run.close()


def test_model_info_shows_the_id_space(served: RawServed) -> None:
    info = served.client.get("/v1/model").json()
    assert info["id_space"] == {
        "mode": "dynamic",
        "unknown_row": 0,
        "count_features": ["user", "item"],
        "time_features": True,
        "dense_features": {"price": "log1p"},
        "tables": [
            {"feature": f, "table": f"embeddings.{f}", "rows": 32, "ids_held": held}
            | {"capacity": 31}
            for f, held in (("user", 10), ("item", 4), ("genres", 2))
        ],
    }
    kinds = {f["name"]: f["kind"] for f in info["features"]}
    assert kinds["user"] == "sparse" and kinds["genres"] == "bag"
    assert kinds["hour_sin"] == kinds["user_prior_log"] == "derived"
    assert kinds["price"] == "dense" and "price_log1p" not in kinds  # what a client sends


def test_raw_ids_are_mapped_and_unknown_ones_reported(served: RawServed) -> None:
    asked = [
        {"user": "u3", "item": 2, "genres": ["Drama"], "ts": TS, "price": 12.5},
        {"user": "stranger", "item": "2", "genres": ["Drama", "Western"]},
        {"item": 1, "price": None},
        {"user": "u3", "item": 2, "genres": ["Drama"], "ts": TS},
    ]
    r = served.predict(*asked)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["version"] == 1
    # the stranger and the example without a user both read the unknown row
    assert body["unknown_ids"] == {"user": 2, "item": 0, "genres": 1}
    # a price, or none (missing), scored by the trainer's own rule
    for i in (0, 3):
        np.testing.assert_allclose(body["scores"][i], served.run.scores([asked[i]]), atol=1e-6)
    assert body["scores"][0] != body["scores"][3]
    metrics = served.client.get("/metrics").text.splitlines()
    assert 'checknrun_server_raw_ids_total{feature="user"} 3.0' in metrics
    assert 'checknrun_server_unknown_ids_total{feature="user"} 2.0' in metrics
    assert 'checknrun_server_unknown_ids_total{feature="genres"} 1.0' in metrics
    # the same examples in the columnar form
    names = ("user", "item", "ts", "price")
    columns: dict[str, list[Any]] = {n: [ex.get(n) for ex in asked] for n in names}
    columns["ts"] = [ex.get("ts", float("nan")) for ex in asked]  # NaN: none, the request time
    columns["price"] = [12.5, float("nan"), float("nan"), float("nan")]  # NaN: missing
    columns["genres"] = [g for ex in asked for g in ex.get("genres", [])]
    columns["genres_lengths"] = [len(ex.get("genres", [])) for ex in asked]
    r = served.client.post("/v1/predict", content=json.dumps({"columns": columns}))
    assert r.status_code == 200, r.text
    assert r.json()["unknown_ids"] == body["unknown_ids"]
    np.testing.assert_allclose(r.json()["scores"], body["scores"], atol=1e-6)


def test_a_new_id_is_served_once_its_version_is_applied(served: RawServed) -> None:
    asked = {"user": "late", "item": 1, "ts": TS}
    assert served.predict(asked).json()["unknown_ids"]["user"] == 1
    train(served.run, ["late", "late"], ts=TS + 100)
    v2 = served.run.publish()
    wait_for(lambda: served.version() == v2, what=f"version {v2}")
    body = served.predict(asked).json()
    assert body["version"] == v2 and body["unknown_ids"]["user"] == 0
    np.testing.assert_allclose(body["scores"], served.run.scores([asked]), atol=1e-6)
    tables = served.client.get("/v1/model").json()["id_space"]["tables"]
    assert tables[0]["ids_held"] == 11


@pytest.mark.parametrize(
    ("example", "feature", "kind"),
    [
        ({"user": True}, "user", "bad_id"),
        ({"user": 1.5}, "user", "bad_id"),
        ({"user": ""}, "user", "bad_id"),
        ({"user": "x" * 300}, "user", "bad_id"),
        ({"genres": "Drama"}, "genres", "wrong_type"),
        ({"genres": ["a"] * 5000}, "genres", "too_many_ids"),
        ({"ts": "yesterday"}, "ts", "bad_ts"),
        ({"ts": -5}, "ts", "bad_ts"),
        ({"hour_sin": 0.5}, "hour_sin", "unknown_feature"),  # derived, never sent
        ({"price": "12"}, "price", "bad_dense"),
        ({"price": 10**400}, "price", "bad_dense"),
        ({"price_missing": 1}, "price_missing", "unknown_feature"),
    ],
)
def test_bad_raw_examples_are_422_with_their_place(
    served: RawServed, example: dict[str, Any], feature: str, kind: str
) -> None:
    r = served.predict({"user": "u1"}, example)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert detail[0]["loc"] == ["body", "examples", 1, feature]
    assert detail[0]["type"] == kind


def test_openapi_documents_raw_ids(served: RawServed) -> None:
    spec = served.client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    assert "unknown_ids" in schemas["PredictResponse"]["properties"]
    assert "id_space" in schemas["ModelInfo"]["properties"]
    assert {"IdSpaceInfo", "IdTableInfo"} <= set(schemas)
    request = schemas["PredictRequest"]
    examples = request["examples"]
    assert any("ts" in e for ex in examples for e in ex.get("examples", []))
    assert any("columns" in ex for ex in examples)
    assert "columnar" in request["properties"]["columns"]["description"]
    assert "raw events" in request["properties"]["examples"]["description"]
