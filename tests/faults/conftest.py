"""Fixtures of the fault suite: private Kafka and MinIO, trainer and server processes.

Fault tests stop and restart the broker and the object store. Other suites (and colleagues'
concurrent runs) use the shared services of scripts/services.sh, so this suite starts its OWN pair
with another `CHECKNRUN_SERVICES_DIR`: other ports and data, the same cached Kafka jars and MinIO
binary. `private_services.down("kafka")` / `.up("kafka")` then only hurt this suite. The pair is
stopped at the end of the session (its run dir is kept, so the next session starts in ~10 s).

Every test here is marked `integration` and `faults` (tests/conftest.py; `pytest -m faults` runs
just this suite).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.child_server import ChildServer
from tests.support import parse_env_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SERVICES_SCRIPT = REPO / "scripts" / "services.sh"
CACHE = Path(os.environ.get("CHECKNRUN_CACHE") or Path.home() / ".cache" / "checknrun")
#: not under $CACHE/services: services.sh recognises its processes by the run dir in their
#: command line, and a name with the shared dir as a prefix would blur that check.
PRIVATE_DIR = CACHE / "faults-services"
# A first run on a new machine builds MinIO before anything starts.
SERVICES_UP_TIMEOUT_S = 45 * 60
ADMIN_TOKEN = "faults-admin-token-7f3a9c2e5b"


@dataclass
class PrivateServices:
    """This suite's own Kafka + MinIO; `down`/`up` keep their ports and data."""

    env: dict[str, str]

    def _run(self, *args: str) -> str:
        done = subprocess.run(
            ["bash", str(SERVICES_SCRIPT), *args],
            env={**os.environ, "CHECKNRUN_SERVICES_DIR": str(PRIVATE_DIR)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            timeout=SERVICES_UP_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"services.sh {' '.join(args)} exited with {done.returncode}")
        return done.stdout

    def up(self, *names: str) -> float:
        """Start (idempotent) and wait until ready; returns the seconds it took."""
        started = time.monotonic()
        self.env = parse_env_file(self._run("up", *names))
        return time.monotonic() - started

    def down(self, *names: str) -> None:
        self._run("down", *names)

    @property
    def kafka_bootstrap(self) -> str:
        return self.env["CHECKNRUN_KAFKA_BOOTSTRAP"]


@pytest.fixture(scope="session")
def private_services() -> Iterator[PrivateServices]:
    """A Kafka broker and a MinIO server that only this suite uses, stopped at the end."""
    services = PrivateServices(env={})
    services.up()
    try:
        yield services
    finally:
        services.down()


@pytest.fixture
def unique_name() -> str:
    """A fresh name valid as a Kafka topic, an S3 bucket and a model name."""
    return f"ft-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def proc_env(private_services: PrivateServices) -> dict[str, str]:
    """The environment of trainer/server subprocesses: the private services' settings."""
    # Ensure both are up: an earlier test may have failed half-way through an outage.
    private_services.up()
    return {
        **os.environ,
        **private_services.env,
        "PYTHONUNBUFFERED": "1",
        "CHECKNRUN_SERVER_ADMIN_TOKEN": ADMIN_TOKEN,
    }


@pytest.fixture
def s3_env(proc_env: dict[str, str]) -> Iterator[None]:
    """Makes `open_store("s3://...")` in this process talk to the private MinIO."""
    keys = [
        k for k in proc_env if k.startswith("CHECKNRUN_S3_") or k == "CHECKNRUN_KAFKA_BOOTSTRAP"
    ]
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: proc_env[k] for k in keys})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --- processes ------------------------------------------------------------------------------


def train_args(
    store: str,
    model: str,
    *,
    bus: str | None = None,
    max_samples: int = 12_288,
    interval_samples: int = 2048,
    codec: str = "fp32",
    resume: bool = False,
    extra: Sequence[str] = (),
) -> list[str]:
    """A small synthetic `checknrun train` run (26 tables of <= 2000 rows, dim 8, ~5 s)."""
    args = [
        sys.executable,
        "-m",
        "trainer.cli",
        "train",
        "--data",
        "synthetic",
        "--table-cap",
        "2000",
        "--embedding-dim",
        "8",
        "--store",
        store,
        "--model",
        model,
        "--codec",
        codec,
        "--interval-samples",
        str(interval_samples),
        "--max-samples",
        str(max_samples),
        "--json",
        "--no-progress",
        *extra,
    ]
    if bus:
        args += ["--bus", bus]
    if resume:
        args.append("--resume")
    return args


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str

    def report(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.stdout)
        return doc


class Processes:
    """Starts subprocesses and kills (by pid) whatever is still running at teardown."""

    def __init__(self, tmp: Path, env: Mapping[str, str]) -> None:
        self.tmp = tmp
        self.env = dict(env)
        self.started: list[subprocess.Popen[bytes]] = []
        self.servers: list[ChildServer] = []

    def spawn(
        self, args: Sequence[str], name: str, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        out = (self.tmp / f"{name}.out").open("wb")
        err = (self.tmp / f"{name}.err").open("wb")
        proc = subprocess.Popen(
            list(args),
            cwd=REPO,
            env={**self.env, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
        )
        out.close()
        err.close()
        self.started.append(proc)
        return proc

    def finish(self, proc: subprocess.Popen[bytes], name: str, timeout: float = 180) -> Finished:
        code = proc.wait(timeout=timeout)
        return Finished(
            code,
            (self.tmp / f"{name}.out").read_text(),
            (self.tmp / f"{name}.err").read_text(errors="replace"),
        )

    def run(
        self,
        args: Sequence[str],
        name: str,
        env: Mapping[str, str] | None = None,
        timeout: float = 180,
    ) -> Finished:
        return self.finish(self.spawn(args, name, env), name, timeout)

    def server(
        self,
        store: str,
        model: str,
        name: str,
        *,
        bus: str | None = None,
        port: int = 0,
        **flags: str,
    ) -> ChildServer:
        """A `checknrun serve` child (its output in `name`.log), SIGKILLed at teardown."""
        log = self.tmp / f"{name}.log"
        server = ChildServer(store, model, log, port=port, env=self.env, bus=bus or None, **flags)
        self.servers.append(server)
        return server

    def close(self) -> None:
        for server in self.servers:
            server.kill()
        for proc in self.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)


@pytest.fixture
def procs(tmp_path: Path, proc_env: dict[str, str]) -> Iterator[Processes]:
    processes = Processes(tmp_path, proc_env)
    try:
        yield processes
    finally:
        processes.close()


def metric_value(text: str, name: str, labels: str = "") -> float:
    """The value of `checknrun_server_NAME{labels}` in Prometheus text (0 when absent)."""
    wanted = f"checknrun_server_{name}{{{labels}}}" if labels else f"checknrun_server_{name}"
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return 0.0


def examples_for(
    features: Sequence[Mapping[str, Any]], n: int, seed: int = 0
) -> list[dict[str, Any]]:
    """`n` valid predict examples for the features `GET /v1/model` lists."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for _ in range(n):
        example: dict[str, Any] = {}
        for f in features:
            if f["kind"] == "dense":
                example[f["name"]] = rng.uniform(-1, 1)
            elif f["kind"] == "bag":
                example[f["name"]] = [rng.randrange(f["rows"]) for _ in range(2)]
            else:
                example[f["name"]] = rng.randrange(f["rows"])
        out.append(example)
    return out


def s3_url(bucket: str) -> str:
    return f"s3://{bucket}/faults"


def kafka_url(services: PrivateServices, topic: str) -> str:
    return f"kafka://{services.kafka_bootstrap}/{topic}"
