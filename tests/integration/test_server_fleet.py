"""A fleet of real server processes following a training run over real Kafka and MinIO.

Two servers (one per consistency scheme) follow from the start; a third starts half-way and
catches up. All three must end on the same version with bitwise-identical tensors, equal to what
`restore()` rebuilds from the store, and answer the same scores, which equal the restored model's
and are within codec error of the trainer's own fp32 model.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.child_server import ChildServer
from bench.synthetic_run import SyntheticRun, model_scores, random_examples, small_config
from publisher.bus import open_announcer
from publisher.dlrm import DLRM, DLRMConfig
from publisher.read.restore import restore
from publisher.store.s3_store import S3Store
from tests.integration.test_s3_store import s3_environ

MODEL = "fleet"
TOKEN = "fleet-admin-token-0123456789"


def service_env(services: Any) -> dict[str, str]:
    """The S3 and Kafka variables that point a child process at the test services."""
    return {**s3_environ(services), "CHECKNRUN_KAFKA_BOOTSTRAP": services.kafka_bootstrap}


def digest(server: ChildServer) -> dict[str, Any]:
    """The server's tensor digests (an admin route)."""
    r = server.client.get("/v1/model/digest", headers={"Authorization": f"Bearer {TOKEN}"})
    r.raise_for_status()
    data: dict[str, Any] = r.json()
    return data


class Fleet:
    def __init__(self, services: Any, store_url: str, bus_url: str, tmp: Path) -> None:
        self.env = {**os.environ, **service_env(services), "CHECKNRUN_SERVER_ADMIN_TOKEN": TOKEN}
        self.store_url, self.bus_url, self.tmp = store_url, bus_url, tmp
        self.servers: list[ChildServer] = []

    def start(self, scheme: str) -> ChildServer:
        server = ChildServer(
            self.store_url,
            MODEL,
            self.tmp / f"server-{len(self.servers)}.log",
            env=self.env,
            bus=self.bus_url,
            consistency=scheme,
            poll_head_after="2",
        )
        self.servers.append(server)
        return server

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


@pytest.fixture
def fleet(services: Any, unique_name: str, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(
        services,
        f"s3://{unique_name}/models",
        f"kafka://{services.kafka_bootstrap}/{unique_name}",
        tmp_path,
    )
    yield f
    f.stop()
    for s in f.servers:
        assert TOKEN not in s.log.read_text()  # never logged
        assert services.s3_secret_key not in s.log.read_text()


def tensor_digests(state: Any) -> dict[str, str]:
    # Keyed like the server's digest: tables by table name, dense tensors by state name.
    out = {
        name: hashlib.sha256(t.weights.tobytes()).hexdigest() for name, t in state.tables.items()
    }
    out.update(
        {
            k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()
            for k, v in state.dense.items()
        }
    )
    return out


def test_fleet_follows_a_training_run(services: Any, fleet: Fleet) -> None:
    env = service_env(services)
    store = S3Store.from_url(fleet.store_url, environ=env)
    announcer = open_announcer(fleet.bus_url, MODEL)
    config = small_config(rows=(50_000, 2_000), dim=16)
    run = SyntheticRun(store, MODEL, config, codec="int8", announce=announcer.announce)
    try:
        run.train(5, rows_per_step=256)
        run.publish("full")
        announcer.flush(10)
        a, b = fleet.start("double-buffer"), fleet.start("rwlock")
        a.wait_ready()
        b.wait_ready()

        def train_and_publish(n: int) -> int:
            version = 0
            for i in range(n):
                run.train(3, rows_per_step=256)
                kind = "full" if i == 2 else "delta"  # an intermittent baseline mid-run
                version = run.publish(kind).ref.version  # type: ignore[arg-type]
                time.sleep(0.2)
            return version

        train_and_publish(4)
        late = fleet.start("double-buffer")  # joins half-way: bootstraps from HEAD
        head = train_and_publish(4)
        announcer.flush(10)
        late.wait_ready()
        for server in (a, b, late):
            server.wait_version(head)

        digests = [digest(s) for s in (a, b, late)]
        assert {d["version"] for d in digests} == {head}
        assert digests[0]["tensors"] == digests[1]["tensors"] == digests[2]["tensors"]
        state = restore(store, MODEL, head)
        assert tensor_digests(state) == digests[0]["tensors"]

        infos = [s.info() for s in (a, b, late)]
        assert all(i["rejected_versions"] == 0 for i in infos)
        assert infos[2]["versions_applied"] < infos[0]["versions_applied"]  # it skipped history

        examples = random_examples(config, 32, seed=5)
        answers = [
            s.client.post("/v1/predict", json={"examples": examples}).json() for s in (a, b, late)
        ]
        assert {r["version"] for r in answers} == {head}
        assert answers[0]["scores"] == answers[1]["scores"] == answers[2]["scores"]
        restored = DLRM(DLRMConfig.from_json(state.manifest.model_config_))
        restored.load_state_dict(
            {
                **{f"{n}.weight": torch.from_numpy(t.weights) for n, t in state.tables.items()},
                **{k: torch.from_numpy(v) for k, v in state.dense.items()},
            }
        )
        served = np.asarray(answers[0]["scores"])
        np.testing.assert_allclose(served, model_scores(restored, examples), rtol=0, atol=1e-6)
        assert np.max(np.abs(served - model_scores(run.model, examples))) < 5e-3
    finally:
        run.close()
        announcer.close()
        store.close()
