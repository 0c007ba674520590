"""compose.yaml's security defaults: servers log in as the read-only user and publish their ports
on loopback only. (scripts/validate_compose.sh checks the file against the Compose spec; what
the read-only policy allows on a real MinIO is tests/integration/test_compose_policy.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"
SERVERS = ("server-1", "server-2")


def _services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())["services"]
    return services


def test_servers_use_the_read_only_user_not_the_root_credentials() -> None:
    services = _services()
    root = services["minio"]["environment"]
    for name in SERVERS:
        env = services[name]["environment"]
        assert env["CHECKNRUN_S3_ACCESS_KEY"].startswith("${CHECKNRUN_S3_READER_ACCESS_KEY:-")
        assert env["CHECKNRUN_S3_SECRET_KEY"].startswith("${CHECKNRUN_S3_READER_SECRET_KEY:-")
        assert env["CHECKNRUN_S3_ACCESS_KEY"] != root["MINIO_ROOT_USER"]
        assert env["CHECKNRUN_S3_SECRET_KEY"] != root["MINIO_ROOT_PASSWORD"]


def test_the_init_container_creates_and_attaches_the_read_policy() -> None:
    init = _services()["minio-init"]
    command = " ".join(init["command"])
    for step in ("mc admin policy create", "mc admin user add", "mc admin policy attach"):
        assert step in command
    assert init["configs"][0]["source"] == "checknrun-read-policy"
    policy = yaml.safe_load(COMPOSE.read_text())["configs"]["checknrun-read-policy"]["content"]
    actions = {a for s in json.loads(policy)["Statement"] for a in s["Action"]}
    assert actions == {"s3:ListBucket", "s3:GetObject"}


def test_server_ports_are_published_on_loopback_unless_configured() -> None:
    services = _services()
    for name in SERVERS:
        for port in services[name]["ports"]:
            assert isinstance(port, str) and port.startswith("${CHECKNRUN_SERVER_BIND:-127.0.0.1}:")
    for port in services["minio"]["ports"]:
        assert port.startswith("127.0.0.1:")
