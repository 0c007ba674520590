"""Raw-id serving for real: a small model trained from raw ids, published by the real
IncrementalCheckpointer with its id maps to MinIO and announced on Kafka, followed by two
`checknrun serve` processes (one per consistency scheme).

A new id trained online reaches the servers: unknown (row 0) until the version that carries its
row is applied, then mapped to it. An evicted id's row, re-initialised and given to a new id,
serves the new id's values (bitwise the trainer's), and the old id is unknown. Both servers hold
exactly the maps and rows `restore()` rebuilds from the store.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.child_server import ChildServer
from bench.synthetic_live import SyntheticLiveRun
from publisher.read.model_copy import id_map_digest
from publisher.read.restore import restore
from publisher.store import ObjectStore
from publisher.store.s3_store import S3Store
from tests.integration.test_server_fleet import service_env

MODEL = "live"
TOKEN = "live-serving-admin-token-0123456789"
TS = 1_700_000_000.0


def events(users: list[str], ts: float) -> list[dict[str, Any]]:
    return [
        {"user": u, "item": i % 5, "genres": ["Drama", "Noir"][: i % 3], "ts": ts + i}
        | {"label": i % 2}
        for i, u in enumerate(users)
    ]


def predict(server: ChildServer, examples: list[dict[str, Any]]) -> dict[str, Any]:
    r = server.client.post("/v1/predict", json={"examples": examples})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def served_digest(server: ChildServer) -> dict[str, Any]:
    r = server.client.get("/v1/model/digest", headers={"Authorization": f"Bearer {TOKEN}"})
    r.raise_for_status()
    data: dict[str, Any] = r.json()
    return data


def restored_digest(store: ObjectStore, version: int) -> dict[str, str]:
    """What the servers' digest of `version` must be: restore's rows, dense tensors, maps."""
    state = restore(store, MODEL, version)
    out = {n: hashlib.sha256(t.weights.tobytes()).hexdigest() for n, t in state.tables.items()}
    out |= {
        k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()
        for k, v in state.dense.items()
    }
    out |= {f"{n}.id_map": id_map_digest(m) for n, m in state.id_maps.items()}
    return out


def test_new_and_reused_ids_reach_the_servers(
    services: Any, unique_name: str, tmp_path: Path
) -> None:
    env = service_env(services)
    store_url = f"s3://{unique_name}/models"
    bus_url = f"kafka://{services.kafka_bootstrap}/{unique_name}"
    store = S3Store.from_url(store_url, environ=env)
    run = SyntheticLiveRun(store, MODEL, bus=bus_url)
    servers: list[ChildServer] = []
    try:
        run.train(events([f"u{i}" for i in range(12)], TS))
        run.publish()
        child_env = {**os.environ, **env, "CHECKNRUN_SERVER_ADMIN_TOKEN": TOKEN}
        for scheme in ("double-buffer", "rwlock"):
            servers.append(
                ChildServer(
                    store_url,
                    MODEL,
                    tmp_path / f"{scheme}.log",
                    env=child_env,
                    bus=bus_url,
                    consistency=scheme,
                    poll_head_after="2",
                )
            )
        for server in servers:
            server.wait_ready()

        fresh = [{"user": "fresh", "item": 1, "ts": TS + 500}]
        for server in servers:
            assert predict(server, fresh)["unknown_ids"]["user"] == 1

        # A new id trained online: served once the version carrying its row is applied.
        run.train(events(["fresh"] * 3, TS + 100))
        v2 = run.publish()
        for server in servers:
            server.wait_version(v2)
            body = predict(server, fresh)
            assert body["version"] == v2 and body["unknown_ids"]["user"] == 0
            np.testing.assert_allclose(body["scores"], run.scores(fresh), rtol=0, atol=1e-6)

        # Evict u0, give its row to a new id: the row is re-initialised, then trained.
        old_row = run.id_map("user").row_of("u0")
        assert old_row is not None
        old_values = run.model.embeddings["user"].weight[old_row].detach().clone()
        assert run.evict("user", "u0") == old_row
        run.train(events(["reuse", "reuse"], TS + 200))
        assert run.id_map("user").row_of("reuse") == old_row
        assert not torch.allclose(run.model.embeddings["user"].weight[old_row], old_values)
        v3 = run.publish()
        asked = [{"user": "reuse", "item": 2, "ts": TS + 600}, {"user": "u0", "item": 2}]
        expected = restored_digest(store, v3)
        for server in servers:
            server.wait_version(v3)
            body = predict(server, asked)
            assert body["version"] == v3
            assert body["unknown_ids"]["user"] == 1  # u0 is gone; "reuse" holds its row
            np.testing.assert_allclose(body["scores"][:1], run.scores(asked[:1]), atol=1e-6)
            digest = served_digest(server)
            assert digest["version"] == v3 and digest["tensors"] == expected
            tables = {t["feature"]: t for t in server.info()["id_space"]["tables"]}
            assert tables["user"]["ids_held"] == len(run.id_map("user")) == 13
        # The served user table is the trainer's, bit for bit: the reused row holds the new
        # id's re-initialised and trained values, not the old id's; the rows no id holds are
        # zero (the first full left them out, docs/FORMAT.md 7.1, and no delta wrote them).
        trainer_user = run.model.embeddings["user"].weight.detach().numpy().copy()
        user_map = run.id_map("user")
        free = [r for r in range(1, len(trainer_user)) if user_map.key_of(r) is None]
        assert free
        trainer_user[free] = 0.0
        assert expected["embeddings.user"] == hashlib.sha256(trainer_user.tobytes()).hexdigest()
        for server in servers:
            assert server.info()["rejected_versions"] == 0
    finally:
        for server in servers:
            server.stop()
        run.close()
        for info in list(store.list("")):
            store.delete(info.key)
        store.close()
