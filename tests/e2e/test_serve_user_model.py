"""`checknrun serve --model-factory ... --request-adapter ...` as a user runs it: a real `serve`
process following a user's own model (examples/) that this process trains online and publishes
with a file bus, its answers moving to each new version and equal to that version's restore."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.child_server import ChildServer
from tests.user_model_runs import RUNS

pytest.importorskip("torchrec")
pytestmark = pytest.mark.slow

INT4_ATOL = 1e-5


@pytest.mark.parametrize(("model", "codec"), [("two_tower", "auto"), ("deepfm", "int4")])
def test_serve_follows_a_user_model_through_the_command(
    tmp_path: Path, model: str, codec: str
) -> None:
    store = f"file://{tmp_path / 'store'}"
    bus = f"file://{tmp_path / 'announcements.log'}"
    run = RUNS[model](store, model, codec=codec, bus=bus)
    try:
        run.train(7)
        run.checkpoint()
        with ChildServer(
            store,
            model,
            tmp_path / "server.log",
            bus=bus,
            model_factory=f"examples.{model}:build",
            request_adapter=f"examples.{model}:requests",
        ) as server:
            server.wait_ready()
            examples = run.requests(16)
            version = 1
            for step in range(3):
                if step:  # the bus announces it; the server follows
                    run.train(7)
                    version = run.checkpoint()
                server.wait_version(version, timeout_s=30)
                body = server.client.post("/v1/predict", json={"examples": examples}).json()
                assert body["version"] == version, body
                np.testing.assert_allclose(
                    body["scores"], run.restored_scores(version, examples), rtol=0, atol=INT4_ATOL
                )
            info = server.info()
            assert info["architecture"] == model
            assert info["last_apply"] is not None and info["last_apply"]["heard_at"] is not None
    finally:
        run.close()
