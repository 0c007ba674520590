"""Ray Serve kept live (examples/ray_serve_live.py) for real: a local Ray started here, the
deployment's replica following a two-tower model this process trains online (int4, raw string
ids through id maps) and publishes with a file bus, and a DeepFM model on TorchRec published with
`codec="auto"`, queried over HTTP through Ray Serve's proxy.
Its answers move to each new version and equal that version's restore; bad requests are 4xx
answers and the replica keeps serving."""

from __future__ import annotations

import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from bench.child_server import free_port
from tests.support import wait_for
from tests.user_model_runs import UserRun

serve = pytest.importorskip(
    "ray.serve", reason="the serve-ray extra: pip install -e '.[serve-ray]'"
)
ray = pytest.importorskip("ray")

from examples.ray_serve_live import (  # noqa: E402
    LiveModelDeployment,
    LiveModelReplica,
    RequestRefused,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
#: int4 rows decode exactly on both sides; only bag sums may round differently.
INT4_ATOL = 1e-5
#: a replica's start (imports torch and the model, bootstraps) on a loaded 2-core machine.
DEPLOY_S = 120.0
VERSION_S = 30.0


@pytest.fixture(scope="module")
def proxy() -> Iterator[str]:
    """One local Ray and Serve for the module: the proxy's base URL (loopback only)."""
    # Short: Ray's unix sockets live under it (108 bytes at most), not under pytest's tmp_path.
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    port = free_port()
    sigterm = signal.getsignal(signal.SIGTERM)  # ray.init replaces it, and shutdown leaves it
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # Token auth as Ray's default has it, the token in the environment: no ~/.ray written.
        patch.setenv("RAY_AUTH_TOKEN", uuid.uuid4().hex)
        try:
            ray.init(
                num_cpus=2,
                include_dashboard=False,
                log_to_driver=False,
                _temp_dir=temp,
                _node_ip_address="127.0.0.1",
                # The replicas import `examples` and the repo's packages from the checkout,
                # with no working_dir upload.
                runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
            )
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            yield f"http://127.0.0.1:{port}"
        finally:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
                signal.signal(signal.SIGTERM, sigterm)
                shutil.rmtree(temp, ignore_errors=True)


def _answer(client: httpx.Client, examples: list[dict[str, Any]]) -> dict[str, Any]:
    response = client.post("/", json={"examples": examples})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _served_version(client: httpx.Client) -> int | None:
    try:
        response = client.get("/model")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    version: int | None = response.json()["version"]
    return version


def _wait_served(client: httpx.Client, version: int, timeout_s: float) -> None:
    wait_for(
        lambda: (_served_version(client) or 0) >= version,
        timeout_s,
        lambda: f"the replica serving v{version} (GET /model: v{_served_version(client)})",
        poll_s=0.1,
    )


def test_ray_serve_follows_a_two_tower_model(proxy: str, tmp_path: Path) -> None:
    store = f"file://{tmp_path / 'store'}"
    bus = f"file://{tmp_path / 'announcements.log'}"
    run = UserRun.of("two_tower", store, "tt", codec="int4", bus=bus)
    try:
        run.train(7)
        version = run.checkpoint()
        app = LiveModelDeployment.bind(
            store,
            "tt",
            model_factory="examples.two_tower:build",
            request_adapter="examples.two_tower:requests",
            bus=bus,
            poll_head_after_s=0.5,
        )
        serve.run(app, name="tt", route_prefix="/tt")
        with httpx.Client(base_url=f"{proxy}/tt", timeout=30.0) as client:
            _wait_served(client, version, DEPLOY_S)
            examples = run.requests(16)
            seen = []
            for step in range(3):
                if step:  # the bus announces it; the replica follows
                    run.train(7)
                    version = run.checkpoint()
                    _wait_served(client, version, VERSION_S)
                body = _answer(client, examples)
                assert body["model"] == "tt"
                assert body["version"] == version, body
                np.testing.assert_allclose(
                    body["scores"], run.restored_scores(version, examples), rtol=0, atol=INT4_ATOL
                )
                # Ids the version does not know are served by the unknown row and counted.
                assert body["unknown_ids"] == _unknown(run, version, examples), body
                seen.append(body["version"])
            assert seen == sorted(set(seen)) and len(seen) == 3

            _check_refusals(client, version)
            info = client.get("/model").json()
            assert info["architecture"] == "two_tower" and info["following"] is True, info
            assert info["rejected"] == 0, info
            # Refused requests crashed nothing: the same replica still answers.
            assert _answer(client, examples)["version"] == version
        assert serve.status().applications["tt"].status == "RUNNING"
    finally:
        try:
            serve.delete("tt")
        finally:
            run.close()


def test_ray_serve_follows_a_torchrec_model_published_with_codec_auto(
    proxy: str, tmp_path: Path
) -> None:
    """The second architecture: DeepFM on a TorchRec EmbeddingBagCollection, each version's
    codec chosen from its measured served loss."""
    pytest.importorskip("torchrec")
    store = f"file://{tmp_path / 'store'}"
    run = UserRun.of("deepfm", store, "dfm", codec="auto")
    try:
        run.train(7)
        version = run.checkpoint()
        app = LiveModelDeployment.bind(
            store,
            "dfm",
            model_factory="examples.deepfm:build",
            request_adapter="examples.deepfm:requests",
            poll_head_after_s=0.2,  # no bus: HEAD polls
        )
        serve.run(app, name="dfm", route_prefix="/dfm")
        with httpx.Client(base_url=f"{proxy}/dfm", timeout=30.0) as client:
            examples = run.requests(16)
            for step in range(2):
                if step:
                    run.train(7)
                    version = run.checkpoint()
                _wait_served(client, version, DEPLOY_S if step == 0 else VERSION_S)
                body = _answer(client, examples)
                assert body["version"] == version, body
                np.testing.assert_allclose(
                    body["scores"], run.restored_scores(version, examples), rtol=0, atol=INT4_ATOL
                )
    finally:
        try:
            serve.delete("dfm")
        finally:
            run.close()


def _unknown(run: UserRun, version: int, examples: list[dict[str, Any]]) -> dict[str, int]:
    _, id_maps, _ = run.restored(version)
    return {
        field: int(np.count_nonzero(id_maps[field].lookup([e[field] for e in examples]) == 0))
        for field in ("user", "item")
    }


def _check_refusals(client: httpx.Client, version: int) -> None:
    """Each bad request is a 4xx JSON answer naming what is wrong and the served version."""
    good = {"user": "u1", "item": "i1", "history": [1], "categories": [2]}
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, "JSON"),
        ({"json": {"examples": []}}, 422, "empty"),
        ({"json": [good]}, 422, "examples"),
        ({"json": {"examples": [good], "extra": 1}}, 422, "extra"),
        ({"json": {"examples": [{**good, "history": "3"}]}}, 422, "history"),  # adapter refuses
        ({"json": {"examples": [{**good, "user": {"id": 1}}]}}, 422, "user"),  # not an id
        ({"json": {"examples": [good] * 1025}}, 413, "1025"),
    ]
    for request, status, mentions in cases:
        response = client.post("/", **request)
        assert response.status_code == status, (request, response.text)
        body = response.json()
        assert mentions in str(body["detail"]), body
        assert body["version"] == version, body
    assert client.get("/").status_code == 405
    assert client.post("/elsewhere", json={}).status_code == 404


def test_replica_waits_for_a_version_then_fails_health_once_stopped(tmp_path: Path) -> None:
    """Without Ray (what Ray Serve calls): before a first version a request is a 503 and the
    replica is healthy; `check_health` raises once the subscriber's thread has ended."""
    store = f"file://{tmp_path / 'store'}"
    run = UserRun.of("two_tower", store, "tt", codec="int4")
    replica = LiveModelReplica(
        store,
        "tt",
        model_factory="examples.two_tower:build",
        request_adapter="examples.two_tower:requests",
        poll_head_after_s=0.2,
    )
    try:
        with pytest.raises(RequestRefused) as refused:
            replica.predict(run.requests(1))
        assert refused.value.status == 503
        replica.check_health()  # waiting for a first version is healthy
        run.train(3)
        version = run.checkpoint()
        assert replica.subscriber.wait_for_version(version, timeout=VERSION_S) == version
        assert replica.predict(run.requests(4))["version"] == version
        replica.check_health()
        replica.subscriber.stop()
        wait_for(lambda: not replica.info()["following"], VERSION_S, "the thread to end")
        with pytest.raises(RuntimeError, match="stopped following"):
            replica.check_health()
    finally:
        try:
            replica.close()
        finally:
            run.close()
