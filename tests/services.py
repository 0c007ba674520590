"""Where the shared Kafka broker and MinIO server of the integration tests listen.

Where the services come from:

* ``CHECKNRUN_KAFKA_BOOTSTRAP`` and ``CHECKNRUN_S3_ENDPOINT`` set in the environment:
  those are used as they are, so the same tests run against the compose stack or
  against a shell that did ``eval "$(scripts/services.sh up)"``.
* otherwise ``scripts/services.sh up`` starts local ones (the first run on a new
  machine builds MinIO, a few minutes) and they are left running for the next
  session; CI stops them.

The `services` fixture (tests/conftest.py) reads them once per session, and only when a test
that needs them runs: a tier without integration tests starts nothing.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.support import parse_env_file

SERVICES_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "services.sh"
# Generous because a new machine builds MinIO from source before anything starts.
SERVICES_UP_TIMEOUT_S = 45 * 60


@dataclass(frozen=True)
class Services:
    """Where the broker and the object store listen, and how to log in to the store."""

    kafka_bootstrap: str
    s3_endpoint: str
    s3_access_key: str
    s3_secret_key: str
    s3_secure: bool
    s3_region: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Services:
        """Reads the ``CHECKNRUN_*`` variables that scripts/services.sh writes."""
        missing = [
            name
            for name in (
                "CHECKNRUN_KAFKA_BOOTSTRAP",
                "CHECKNRUN_S3_ENDPOINT",
                "CHECKNRUN_S3_ACCESS_KEY",
                "CHECKNRUN_S3_SECRET_KEY",
            )
            if not env.get(name)
        ]
        if missing:
            raise ValueError(f"missing service settings: {', '.join(missing)}")
        secure = env.get("CHECKNRUN_S3_SECURE", "0").strip().lower()
        if secure not in {"0", "1", "false", "true"}:
            raise ValueError(f"CHECKNRUN_S3_SECURE={secure!r}: expected 0, 1, false or true")
        return cls(
            kafka_bootstrap=env["CHECKNRUN_KAFKA_BOOTSTRAP"],
            s3_endpoint=env["CHECKNRUN_S3_ENDPOINT"],
            s3_access_key=env["CHECKNRUN_S3_ACCESS_KEY"],
            s3_secret_key=env["CHECKNRUN_S3_SECRET_KEY"],
            s3_secure=secure in {"1", "true"},
            s3_region=env.get("CHECKNRUN_S3_REGION") or "us-east-1",
        )


def start_local_services() -> Services:
    """Runs ``scripts/services.sh up`` and reads the env file it prints."""
    try:
        # stdout is the env file; progress goes to stderr, left to pytest's capture
        # (visible live with -s, which matters during the first MinIO build).
        done = subprocess.run(
            ["bash", str(SERVICES_SCRIPT), "up"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            timeout=SERVICES_UP_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{SERVICES_SCRIPT} up took over {SERVICES_UP_TIMEOUT_S}s") from exc
    if done.returncode != 0:
        raise RuntimeError(
            f"{SERVICES_SCRIPT} up exited with {done.returncode}; its log tail is above"
        )
    return Services.from_env(parse_env_file(done.stdout))


def services_from_environment() -> Services:
    """The services the environment names, else local ones started now."""
    if os.environ.get("CHECKNRUN_KAFKA_BOOTSTRAP") and os.environ.get("CHECKNRUN_S3_ENDPOINT"):
        return Services.from_env(os.environ)
    return start_local_services()
