"""`checknrun serve --model-factory MODULE:FUNCTION --request-adapter MODULE:FUNCTION`: the REST
API serving a user's own model (examples/two_tower.py: raw ids through id maps;
examples/deepfm.py: a TorchRec EmbeddingBagCollection), through the app in this process.

Covers: /v1/model names the architecture, the adapter's features and the id maps; predictions
answer with the version they were computed with and equal that version's restore (int4 within a
bag sum's rounding); raw ids are mapped with the served version's maps and the unknown ones
counted; the adapter's refusals and bad raw ids are 422s that name the example; the answers move
to each new version; pin and unpin; the rwlock scheme and float32 tables; a model factory
without an adapter, or a reference that names no callable, is refused before anything starts.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from server.app import create_app
from server.plugins import PluginError
from server.settings import ServerSettings
from tests.support import wait_for
from tests.user_model_runs import RUNS, UserRun

with warnings.catch_warnings():  # starlette's notice about its httpx-based client
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

pytest.importorskip("torchrec")

TOKEN = "t0k3n-for-tests-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INT4_ATOL = 1e-5


def settings(tmp_path: Path, model: str, **overrides: Any) -> ServerSettings:
    base: dict[str, Any] = dict(
        store=f"file://{tmp_path / 'store'}",
        model=model,
        model_factory=f"examples.{model}:build",
        request_adapter=f"examples.{model}:requests",
        poll_timeout_s=0.05,
        poll_head_after_s=0.05,
        retry_initial_s=0.05,
        retry_max_s=0.2,
        admin_token=TOKEN,
    )
    base.update(overrides)
    return ServerSettings(**base)


@pytest.fixture(params=sorted(RUNS))
def model(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def run(tmp_path: Path, model: str) -> Iterator[UserRun]:
    r = RUNS[model](f"file://{tmp_path / 'store'}", model, codec="int4")
    r.train(7)
    r.checkpoint()
    yield r
    r.close()


def served_version(client: TestClient) -> int | None:
    r = client.get("/v1/model")
    return int(r.json()["version"]) if r.status_code == 200 else None


def wait_version(client: TestClient, version: int) -> None:
    wait_for(lambda: served_version(client) == version, 20, f"version {version}")


def test_a_user_model_is_served_as_its_restore_scores_version_by_version(
    tmp_path: Path, model: str, run: UserRun
) -> None:
    examples = run.requests(16)
    with TestClient(create_app(settings(tmp_path, model))) as client:
        for step in range(3):
            version = run_more(run) if step else 1
            wait_version(client, version)
            answer = client.post("/v1/predict", json={"examples": examples})
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert body["model"] == model and body["version"] == version
            np.testing.assert_allclose(
                body["scores"], run.restored_scores(version, examples), rtol=0, atol=INT4_ATOL
            )
        info = client.get("/v1/model").json()
        assert info["architecture"] == model and info["version"] == 3
        assert info["codecs"] and set(info["codecs"]) <= {"int4"}
        assert info["consistency"] == "double-buffer" and info["hashing"] is False


def run_more(run: UserRun) -> int:
    run.train(7)
    return run.checkpoint()


def test_raw_ids_are_mapped_with_the_served_versions_maps(tmp_path: Path) -> None:
    run = RUNS["two_tower"](f"file://{tmp_path / 'store'}", "two_tower", codec="fp32")
    try:
        run.train(7)
        run.checkpoint()
        with TestClient(create_app(settings(tmp_path, "two_tower"))) as client:
            wait_version(client, 1)
            info = client.get("/v1/model").json()
            kinds = {f["name"]: f["kind"] for f in info["features"]}
            assert kinds == {"user": "raw_id", "item": "raw_id"}
            tables = {t["feature"]: t for t in info["id_space"]["tables"]}
            assert tables["user"]["table"] == "user" and tables["user"]["ids_held"] > 0
            known = run.requests(3)
            strangers = [
                dict(e, user="never-seen", item=f"nor-this-{i}") for i, e in enumerate(known)
            ]
            body = client.post("/v1/predict", json={"examples": known + strangers}).json()
            maps = run.restored(1)[1]
            unknown = {
                field: 3 + sum(maps[field].row_of(e[field]) is None for e in known)
                for field in ("user", "item")
            }
            assert body["unknown_ids"] == unknown
            # fp32: bit for bit what the version's restore scores, strangers on row 0.
            assert body["scores"] == run.restored_scores(1, known + strangers).tolist()
            metrics = client.get("/metrics").text.splitlines()
            line = f'checknrun_server_unknown_ids_total{{feature="user"}} {float(unknown["user"])}'
            assert line in metrics
    finally:
        run.close()


def test_what_the_adapter_refuses_is_a_422_naming_it(tmp_path: Path, run: UserRun) -> None:
    model = "deepfm" if "tags" in run.requests(1)[0] else "two_tower"
    with TestClient(create_app(settings(tmp_path, model))) as client:
        wait_version(client, 1)
        good = run.requests(2)
        bad = [dict(good[0]), "not an example"]
        r = client.post("/v1/predict", json={"examples": bad})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "examples", 1]
        wrong = dict(good[0], item=10**6) if model == "deepfm" else dict(good[0], history="x")
        r = client.post("/v1/predict", json={"examples": [good[1], wrong]})
        assert r.status_code == 422
        detail = r.json()["detail"][0]
        assert detail["type"] == "invalid" and "example 1" in detail["msg"]
        if model == "two_tower":
            r = client.post("/v1/predict", json={"examples": [dict(good[0], user=["a", 3.5])]})
            assert r.status_code == 422 and r.json()["detail"][0]["type"] == "bad_id"
        assert client.post("/v1/predict", json={"examples": good}).status_code == 200


def test_pin_and_unpin_a_user_model(tmp_path: Path, run: UserRun) -> None:
    model = "deepfm" if "tags" in run.requests(1)[0] else "two_tower"
    with TestClient(create_app(settings(tmp_path, model))) as client:
        wait_version(client, 1)
        v2 = run_more(run)
        wait_version(client, v2)
        pinned = client.post("/v1/model/pin", json={"version": 1}, headers=AUTH)
        assert pinned.status_code == 200 and pinned.json()["pinned_version"] == 1
        v3 = run_more(run)
        examples = run.requests(4)
        body = client.post("/v1/predict", json={"examples": examples}).json()
        assert body["version"] == 1
        np.testing.assert_allclose(
            body["scores"], run.restored_scores(1, examples), rtol=0, atol=INT4_ATOL
        )
        assert client.post("/v1/model/unpin", headers=AUTH).json()["was_pinned"] is True
        wait_version(client, v3)


@pytest.mark.parametrize(("consistency", "quantized"), [("rwlock", True), ("double-buffer", False)])
def test_either_scheme_and_float32_tables_serve_a_user_model(
    tmp_path: Path, consistency: str, quantized: bool
) -> None:
    run = RUNS["deepfm"](f"file://{tmp_path / 'store'}", "deepfm", codec="int4")
    try:
        run.train(7)
        run.checkpoint()
        overrides = dict(consistency=consistency, quantized_tables=quantized)
        with TestClient(create_app(settings(tmp_path, "deepfm", **overrides))) as client:
            examples = run.requests(8)
            for step in range(2):
                version = run_more(run) if step else 1
                wait_version(client, version)
                body = client.post("/v1/predict", json={"examples": examples}).json()
                assert body["version"] == version
                np.testing.assert_allclose(
                    body["scores"], run.restored_scores(version, examples), rtol=0, atol=INT4_ATOL
                )
            info = client.get("/v1/model").json()
            assert info["consistency"] == consistency
    finally:
        run.close()


def test_a_model_factory_needs_an_adapter_and_references_must_resolve(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="needs a request adapter"):
        settings(tmp_path, "deepfm", request_adapter=None)
    with pytest.raises(PluginError, match="does not import"):
        create_app(settings(tmp_path, "deepfm", model_factory="no_such_module:build"))
    with pytest.raises(PluginError, match="has no nothing_here"):
        create_app(settings(tmp_path, "deepfm", model_factory="examples.deepfm:nothing_here"))
    with pytest.raises(PluginError, match="expected MODULE:FUNCTION"):
        create_app(settings(tmp_path, "deepfm", request_adapter="examples.deepfm"))
    with pytest.raises(PluginError, match="not callable"):
        create_app(settings(tmp_path, "deepfm", request_adapter="examples.deepfm:FEATURES"))


def _v2_inputs(examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A user model's examples as v2 tensors (docs/SERVER.md): a list per example as a bag (its
    values flat and `<name>_lengths`), a string as BYTES, an integer as INT64."""
    inputs: list[dict[str, Any]] = []
    for name in examples[0]:
        column = [ex[name] for ex in examples]
        if isinstance(column[0], list):
            flat = [v for values in column for v in values]
            kind = "FP64" if any(isinstance(v, float) for v in flat) else "INT64"
            inputs.append({"name": name, "datatype": kind, "shape": [len(flat)], "data": flat})
            lengths = [len(values) for values in column]
            inputs.append(
                {
                    "name": f"{name}_lengths",
                    "datatype": "INT64",
                    "shape": [len(column)],
                    "data": lengths,
                }
            )
        else:
            kind = "BYTES" if isinstance(column[0], str) else "INT64"
            inputs.append({"name": name, "datatype": kind, "shape": [len(column)], "data": column})
    return inputs


def test_a_user_model_answers_the_v2_protocol_and_v1_columns_as_v1(
    tmp_path: Path, model: str, run: UserRun
) -> None:
    examples = run.requests(8)
    with TestClient(create_app(settings(tmp_path, model))) as client:
        wait_version(client, 1)
        want = client.post("/v1/predict", json={"examples": examples}).json()
        r = client.post(f"/v2/models/{model}/infer", json={"inputs": _v2_inputs(examples)})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["model_version"] == "1"
        np.testing.assert_allclose(doc["outputs"][0]["data"], want["scores"], rtol=0, atol=1e-6)
        columns = {i["name"]: i["data"] for i in _v2_inputs(examples)}
        r = client.post("/v1/predict", json={"columns": columns})
        assert r.status_code == 200, r.text
        assert r.json()["version"] == 1 and r.json().get("unknown_ids") == want.get("unknown_ids")
        np.testing.assert_allclose(r.json()["scores"], want["scores"], rtol=0, atol=1e-6)
        meta = client.get(f"/v2/models/{model}").json()["inputs"]
        # the adapter's id features, as raw ids; its other inputs are its own to type
        ids = {"two_tower": {"user", "item"}, "deepfm": set()}[model]
        assert {t["name"]: t["datatype"] for t in meta} == dict.fromkeys(ids, "BYTES")
