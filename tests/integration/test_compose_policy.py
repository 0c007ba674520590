"""The policies compose.yaml gives the trainer and the servers, applied to a real MinIO.

minio-init (compose.yaml) creates a user with the policy in `configs.checknrun-write-policy` for
the trainer and one with `configs.checknrun-read-policy` for the servers. Here the same policy
texts, pointed at a test bucket, are created through MinIO's admin API (what `mc admin policy
create` / `user add` / `policy attach` call): the trainer's user must publish versions and
collect garbage while writing outside `models/` and creating buckets are refused; a server logged
in as the reader must bootstrap a model while every write, delete and read outside `models/` is
refused.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from minio import Minio
from minio.credentials import StaticProvider
from minio.minioadmin import MinioAdmin

from bench.synthetic_run import SyntheticRun, small_config
from publisher.read.catalog import Catalog
from publisher.read.retention import plan_gc, run_gc
from publisher.store import StoreError
from publisher.store.s3_store import S3Settings, S3Store
from publisher.write.version_writer import VersionWriter
from tests.integration.conftest import Services
from tests.support import dlrm_live

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"
COMPOSE_BUCKET = "checknrun"


def compose_policy(name: str, bucket: str) -> dict[str, Any]:
    """compose.yaml's policy `name` with its bucket replaced by `bucket`."""
    compose = yaml.safe_load(COMPOSE.read_text())
    text = compose["configs"][name]["content"]
    policy: dict[str, Any] = json.loads(text)
    arn = f"arn:aws:s3:::{COMPOSE_BUCKET}"
    for statement in policy["Statement"]:
        resources = statement["Resource"]
        assert all(r == arn or r.startswith(arn + "/") for r in resources), resources
        statement["Resource"] = [f"arn:aws:s3:::{bucket}" + r[len(arn) :] for r in resources]
    return policy


def settings(services: Services, access_key: str, secret_key: str) -> S3Settings:
    return S3Settings.from_env(
        {
            "CHECKNRUN_S3_ENDPOINT": services.s3_endpoint,
            "CHECKNRUN_S3_ACCESS_KEY": access_key,
            "CHECKNRUN_S3_SECRET_KEY": secret_key,
            "CHECKNRUN_S3_SECURE": "1" if services.s3_secure else "0",
            "CHECKNRUN_S3_REGION": services.s3_region,
        }
    )


@dataclass
class Stores:
    """The bucket as root, the trainer's user and the servers' read-only user see it."""

    admin: S3Settings
    writer: S3Settings
    reader: S3Settings
    bucket: str


@pytest.fixture
def stores(services: Services, minio_client: Minio, unique_name: str) -> Iterator[Stores]:
    bucket = unique_name
    minio_client.make_bucket(bucket)
    admin = MinioAdmin(
        endpoint=services.s3_endpoint,
        credentials=StaticProvider(services.s3_access_key, services.s3_secret_key),
        secure=services.s3_secure,
    )
    users: dict[str, tuple[str, str]] = {}
    for role in ("read", "write"):
        policy_name, user, secret = f"{bucket}-{role}", f"{bucket}-{role}er", uuid.uuid4().hex
        admin.policy_add(policy_name, policy=compose_policy(f"checknrun-{role}-policy", bucket))
        admin.user_add(user, secret)
        admin.attach_policy([policy_name], user=user)
        users[role] = (user, secret)
    try:
        yield Stores(
            admin=settings(services, services.s3_access_key, services.s3_secret_key),
            writer=settings(services, *users["write"]),
            reader=settings(services, *users["read"]),
            bucket=bucket,
        )
    finally:
        for role, (user, _) in users.items():
            admin.user_remove(user)
            admin.policy_remove(f"{bucket}-{role}")
        for obj in minio_client.list_objects(bucket, recursive=True):
            minio_client.remove_object(bucket, obj.object_name or "")
        minio_client.remove_bucket(bucket)


def test_the_trainers_user_publishes_and_collects_under_models_only(stores: Stores) -> None:
    trainer_store = S3Store(stores.bucket, "models", settings=stores.writer)
    run = SyntheticRun(trainer_store, "m", small_config())
    run.train(2)
    run.publish("full")
    versions = [run.train_and_publish() for _ in range(2)]
    run.publish("full")  # a new baseline: the chain before it is garbage
    run.close()
    assert versions == [2, 3]
    plan = plan_gc(trainer_store, "m", keep_baselines=1, grace_s=0.0, now=time.time() + 10)
    assert plan.deleted_versions == [1, 2, 3], "the delete would prove nothing"
    assert run_gc(trainer_store, plan) == len(plan.delete_keys) + len(plan.orphan_keys)
    head = Catalog(S3Store(stores.bucket, "models", settings=stores.admin), "m").head()
    assert head is not None and head.version == 4

    denied = "access denied"
    with pytest.raises(StoreError, match=denied):
        S3Store(stores.bucket, "other", settings=stores.writer).put("x.json", b"{}")
    with pytest.raises(StoreError, match=denied):
        S3Store(f"{stores.bucket}-new", "models", settings=stores.writer).put("x.json", b"{}")


def test_the_servers_user_can_read_but_not_write(stores: Stores) -> None:
    trainer_store = S3Store(stores.bucket, "models", settings=stores.admin)
    run = SyntheticRun(trainer_store, "m", small_config())
    run.train(2)
    run.publish("full")
    run.close()
    S3Store(stores.bucket, "other", settings=stores.admin).put("secret.txt", b"not for servers")

    # A server logged in as the read-only user bootstraps the model (HEAD, manifest, blobs).
    server_store = S3Store(stores.bucket, "models", settings=stores.reader)
    live = dlrm_live(server_store, "m")
    try:
        served = live.bootstrap()
        assert served is not None and served.version == 1
    finally:
        live.close()
    head_key = "m/HEAD"
    assert server_store.get_with_etag(head_key)[0] == trainer_store.get_with_etag(head_key)[0]
    assert [i.key for i in server_store.list("m/manifests/")]

    # ... and can change nothing, nor read outside models/.
    denied = "access denied"
    with pytest.raises(StoreError, match=denied):
        server_store.put("m/forged.json", b"{}")
    with pytest.raises(StoreError, match=denied):
        server_store.put_if(head_key, b"{}", etag=None)
    with pytest.raises(StoreError, match=denied):
        server_store.delete(head_key)
    with pytest.raises(StoreError, match=denied), VersionWriter(server_store, "m"):
        pass  # taking the writer lease is a write
    with pytest.raises(StoreError, match=denied):
        S3Store(stores.bucket, "other", settings=stores.reader).get_with_etag("secret.txt")
    assert trainer_store.get_with_etag(head_key)[0]  # HEAD is still there
