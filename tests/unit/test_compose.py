"""compose.yaml's least privilege, read from the file: who logs in as whom, what no service may
keep (root, capabilities, unbounded memory, a default secret), and which ports are public.
(scripts/validate_compose.sh checks the file against the Compose spec and that it refuses to
load without its secrets; what the store policies allow on a real MinIO is
tests/integration/test_compose_policy.py; the broker's logins and ACLs are checked on the
running stack by tests/compose/test_stack.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"
SERVERS = ("server-1", "server-2")
#: the Kafka user each service of the project's image logs in as.
KAFKA_USERS = {
    "kafka-init": "admin",
    "producer": "producer",
    "trainer": "trainer",
    "server-1": "server",
    "server-2": "server",
}


def _compose() -> dict[str, Any]:
    compose: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return compose


def _services() -> dict[str, Any]:
    services: dict[str, Any] = _compose()["services"]
    return services


def _actions(policy: str) -> set[str]:
    text = _compose()["configs"][policy]["content"]
    return {a for s in json.loads(text)["Statement"] for a in s["Action"]}


def test_the_trainer_and_the_servers_have_store_users_of_their_own() -> None:
    services = _services()
    root = services["minio"]["environment"]
    expected = {"trainer": "TRAINER"} | {name: "READER" for name in SERVERS}
    for name, who in expected.items():
        env = services[name]["environment"]
        assert env["CHECKNRUN_S3_ACCESS_KEY"].startswith(f"${{CHECKNRUN_S3_{who}_ACCESS_KEY:-")
        assert env["CHECKNRUN_S3_SECRET_KEY"].startswith(f"${{CHECKNRUN_S3_{who}_SECRET_KEY:?")
        assert env["CHECKNRUN_S3_ACCESS_KEY"] != root["MINIO_ROOT_USER"]
        assert env["CHECKNRUN_S3_SECRET_KEY"] != root["MINIO_ROOT_PASSWORD"]


def test_the_init_container_creates_both_users_with_their_policies() -> None:
    init = _services()["minio-init"]
    command = " ".join(init["command"])
    for step in ("mc admin policy create", "mc admin user add", "mc admin policy attach"):
        assert step in command
    assert "user checknrun-write" in command and "user checknrun-read" in command
    mounted = {c["source"] for c in init["configs"]}
    assert mounted == {"checknrun-read-policy", "checknrun-write-policy"}
    assert _actions("checknrun-read-policy") == {"s3:ListBucket", "s3:GetObject"}
    write = _actions("checknrun-write-policy")
    assert {"s3:PutObject", "s3:DeleteObject"} <= write
    assert not {a for a in write if a.startswith("admin:") or "Bucket" in a} - {
        "s3:ListBucket",
        "s3:ListBucketMultipartUploads",
    }, "the trainer may not create, delete or configure buckets"


def test_no_secret_has_a_default() -> None:
    text = COMPOSE.read_text()
    variables = re.findall(r"\$\{(CHECKNRUN_\w+)(:?[-?])?", text)
    secrets = {name for name, _ in variables if re.search(r"PASSWORD|SECRET", name)}
    assert len(secrets) == 7, secrets
    for name, how in variables:
        if name in secrets:
            assert how in ("", ":?"), f"{name} has a default"


def test_every_container_runs_unprivileged_and_bounded() -> None:
    for name, service in _services().items():
        assert service.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        assert re.fullmatch(r"\d+[mg]", str(service.get("mem_limit", ""))), name
        if name == "minio-data":
            # The one root step: chown of a new volume, with CHOWN its only capability.
            assert service["user"] == "0:0" and service["cap_add"] == ["CHOWN"]
            assert service["entrypoint"][0] == "chown"
            continue
        assert "cap_add" not in service, name
        user = service.get("user")
        if "build" in service or service["image"].startswith("apache/kafka:"):
            assert user is None, f"{name}: the image's own non-root user"
        else:
            assert user is not None and not user.startswith("0"), name


def test_kafka_takes_only_scram_logins_and_checks_acls() -> None:
    services = _services()
    env = services["kafka"]["environment"]
    protocols = dict(p.split(":") for p in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert set(protocols.values()) == {"SASL_PLAINTEXT"}
    listeners = {listener.split("://")[0] for listener in env["KAFKA_LISTENERS"].split(",")}
    assert listeners <= set(protocols)
    assert env["KAFKA_SASL_ENABLED_MECHANISMS"] == "SCRAM-SHA-512"
    assert env["KAFKA_AUTHORIZER_CLASS_NAME"].endswith("StandardAuthorizer")
    assert env["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false"
    assert env["KAFKA_SUPER_USERS"] == "User:admin"
    for name, user in KAFKA_USERS.items():
        client = services[name]["environment"]
        assert client["CHECKNRUN_KAFKA_USERNAME"] == user, name
        assert client["CHECKNRUN_KAFKA_PASSWORD"].startswith("${CHECKNRUN_KAFKA_"), name


def test_server_ports_are_published_on_loopback_unless_configured() -> None:
    services = _services()
    for name in SERVERS:
        for port in services[name]["ports"]:
            assert isinstance(port, str) and port.startswith("${CHECKNRUN_SERVER_BIND:-127.0.0.1}:")
    for port in services["minio"]["ports"]:
        assert port.startswith("127.0.0.1:")
    exposed = {name for name, service in services.items() if "ports" in service}
    assert exposed == {"minio", *SERVERS}, "Kafka publishes no port"
