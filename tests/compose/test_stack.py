"""compose.yaml run for real: the images built, the stack up, versions published and served.

scripts/compose_stack.sh starts a private Docker engine and builds the images (the first run
on a new machine builds them all, see its header); compose.ci.yaml swaps in local images and
host networking on loopback ports. Then, against the running stack, the live pipeline (the
producer replays MovieLens as raw-id events, the trainer learns from them, the servers follow):

* the trainer publishes at least three versions while the producer still sends events, and
  exits cleanly when stopped (SIGTERM: a last version, exit 0);
* a server replica killed while the trainer publishes, and started again once HEAD moved on,
  catches up to HEAD;
* both replicas answer GET /v1/model with HEAD's version and POST /v1/predict with raw ids
  with 200 and HEAD's version, the user of the first replayed event known (`unknown_ids` 0)
  and a user never sent unknown;
* least privilege, on the running stack: the servers' store user cannot write, the servers'
  Kafka user cannot produce to the events topic, a client without a login gets nothing from
  the broker, and every container runs as a user other than root with a memory limit and no
  capabilities;
* `down -v` leaves no container, volume or network behind, and the engine is stopped again
  if this test started it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from publisher.bus import KafkaAuth, open_source
from publisher.read.catalog import Catalog
from publisher.store import StoreError, open_store
from tests.support import parse_env_file, wait_for

pytestmark = [pytest.mark.compose, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "compose_stack.sh"
CACHE = Path(os.environ.get("CHECKNRUN_CACHE", Path.home() / ".cache" / "checknrun"))
STORE_URL = "s3://checknrun/models"
MODEL = "movielens"
# A new machine debootstraps the base image, builds Compose, mc (and MinIO, if the suite has
# not yet) from Go source and downloads torch into the project image; see the README for the
# times measured.
PREPARE_TIMEOUT_S = 60 * 60
STACK_TIMEOUT_S = 10 * 60
SERVERS = ("server-1", "server-2")
EVENTS_TOPIC = "checknrun.events"

if os.geteuid() != 0:
    pytest.skip("the private Docker engine runs as root", allow_module_level=True)


class Stack:
    """The stack compose.ci.yaml describes, driven through scripts/compose_stack.sh."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.ports = {
            "server-1": int(env["CHECKNRUN_CI_SERVER_1_PORT"]),
            "server-2": int(env["CHECKNRUN_CI_SERVER_2_PORT"]),
        }
        self.kafka = f"127.0.0.1:{env['CHECKNRUN_CI_KAFKA_PORT']}"

    def kafka_config(self, user: str | None, **config: Any) -> dict[str, Any]:
        """A confluent-kafka config logged in as compose.yaml's Kafka `user` (None: no login)."""
        login = KafkaAuth()
        if user is not None:
            password = self.env[f"CHECKNRUN_KAFKA_{user.upper()}_PASSWORD"]
            login = KafkaAuth("SASL_PLAINTEXT", "SCRAM-SHA-512", user, password)
        return {"bootstrap.servers": self.kafka, **config, **login.confluent()}

    def compose(self, *args: str, timeout_s: float = 300) -> str:
        done = subprocess.run(
            ["bash", str(SCRIPT), "compose", *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)} failed:\n{done.stderr[-4000:]}")
        return done.stdout

    def docker(self, *args: str) -> str:
        done = subprocess.run(
            ["docker", "-H", self.env["DOCKER_HOST"], *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return done.stdout

    def state(self, service: str) -> dict[str, str]:
        """`{"status": ..., "exit": ..., "health": ...}` of the service's container."""
        container = self.compose("ps", "--all", "-q", service).strip()
        if not container:
            return {}
        fmt = (
            "{{.State.Status}} {{.State.ExitCode}} "
            "{{if .State.Health}}{{.State.Health.Status}}{{end}}"
        )
        status, code, *health = self.docker("inspect", "-f", fmt, container).split()
        return {"status": status, "exit": code, "health": health[0] if health else ""}

    def head(self) -> int:
        """HEAD's version in the stack's MinIO, as the servers' read-only user sees it (0: none)."""
        head = Catalog(open_store(STORE_URL, create=False), MODEL).head()
        return 0 if head is None else head.version

    def client(self, server: str) -> httpx.Client:
        return httpx.Client(base_url=f"http://127.0.0.1:{self.ports[server]}", timeout=10)

    def served(self, server: str) -> int | None:
        """The version the replica serves, or None while it is down or not ready."""
        try:
            with self.client(server) as http:
                r = http.get("/v1/model")
        except httpx.TransportError:
            return None
        version: int | None = r.json()["version"] if r.status_code == 200 else None
        return version

    def first_event(self) -> dict[str, Any]:
        """The first event the producer sent to partition 0: its users' earliest."""
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer(
            self.kafka_config(
                # The trainer's group: the one its user may look up.
                "trainer",
                **{"group.id": "checknrun-trainer", "enable.auto.commit": False},
            )
        )
        try:
            consumer.assign([TopicPartition(EVENTS_TOPIC, 0, 0)])
            message = consumer.poll(30)
        finally:
            consumer.close()
        assert message is not None and message.error() is None, message and message.error()
        event: dict[str, Any] = json.loads(message.value())
        return event

    def produce_error(self, user: str | None, topic: str) -> str | None:
        """What producing one record to `topic` as `user` ends in: None if delivered, else the
        error (the broker's refusal, or a failure to log in)."""
        from confluent_kafka import Producer

        errors: list[str] = []
        producer = Producer(
            self.kafka_config(
                user,
                **{"message.timeout.ms": 10_000, "error_cb": lambda e: errors.append(str(e))},
            )
        )
        delivered: list[Any] = []
        producer.produce(topic, b"{}", on_delivery=lambda err, msg: delivered.append(err))
        producer.flush(15)
        if delivered and delivered[0] is None:
            return None
        return str(delivered[0]) if delivered else "; ".join(errors) or "not delivered"

    def containers(self) -> dict[str, dict[str, Any]]:
        """service -> what Docker runs its container with, for every container there is."""
        found: dict[str, dict[str, Any]] = {}
        for container in self.compose("ps", "--all", "-q").split():
            info = json.loads(self.docker("inspect", container))[0]
            found[info["Config"]["Labels"]["com.docker.compose.service"]] = info
        return found

    def describe(self) -> str:
        return self.compose("ps", "--all") + self.compose("logs", "--tail", "40", timeout_s=60)


@pytest.fixture(scope="module")
def stack(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[Stack]:
    # One compose test per machine at a time: two would share the engine and the env file.
    lock_dir = CACHE / "compose-stack"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with (lock_dir / ".test-lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        engine_was_up = (
            subprocess.run(["bash", str(SCRIPT), "engine-status"], check=False).returncode == 0
        )
        try:
            prepared = subprocess.run(
                ["bash", str(SCRIPT), "prepare"],
                capture_output=True,
                text=True,
                timeout=PREPARE_TIMEOUT_S,
                check=False,
            )
            print(prepared.stderr)  # the step times, shown with -s or on failure
            assert prepared.returncode == 0, prepared.stderr[-4000:]
            env = parse_env_file(prepared.stdout)
            for name, value in {
                "CHECKNRUN_S3_ENDPOINT": f"127.0.0.1:{env['CHECKNRUN_CI_MINIO_PORT']}",
                "CHECKNRUN_S3_ACCESS_KEY": env["CHECKNRUN_S3_READER_ACCESS_KEY"],
                "CHECKNRUN_S3_SECRET_KEY": env["CHECKNRUN_S3_READER_SECRET_KEY"],
                "CHECKNRUN_S3_SECURE": "0",
                "CHECKNRUN_S3_REGION": "us-east-1",
                # ... and the servers' Kafka login.
                "CHECKNRUN_KAFKA_USERNAME": "server",
                "CHECKNRUN_KAFKA_PASSWORD": env["CHECKNRUN_KAFKA_SERVER_PASSWORD"],
            }.items():
                monkeypatch_module.setenv(name, value)
            stack = Stack(env)
            try:
                yield stack
            finally:
                stack.compose("down", "-v", "--remove-orphans", "--timeout", "20")
        finally:
            if not engine_was_up:
                subprocess.run(["bash", str(SCRIPT), "engine-down"], check=True, timeout=120)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def wait_stack(stack: Stack, probe: Any, what: str, timeout_s: float = STACK_TIMEOUT_S) -> Any:
    """wait_for with the stack's containers and logs in the failure message."""
    return wait_for(probe, timeout_s, lambda: f"{what}\n{stack.describe()}", poll_s=1.0)


def raw_example(features: list[dict[str, Any]], event: dict[str, Any]) -> dict[str, Any]:
    """What a client knows of an event for the served model: its raw ids and its time (the
    dense features are derived by the server)."""
    example = {f["name"]: event[f["name"]] for f in features if f["kind"] != "derived"}
    return {**example, "ts": event["ts"]}


def check_least_privilege(stack: Stack) -> None:
    # The servers' store user (the test's own login: see the fixture) reads, never writes.
    store = open_store(STORE_URL, create=False)
    with pytest.raises(StoreError, match="access denied"):
        store.put("movielens/forged.json", b"{}")

    # The servers' Kafka user may not write events; the producer's may; no login, nothing.
    refused = stack.produce_error("server", EVENTS_TOPIC)
    assert refused is not None and "TOPIC_AUTHORIZATION_FAILED" in refused, refused
    assert stack.produce_error("producer", EVENTS_TOPIC) is None
    assert stack.produce_error(None, EVENTS_TOPIC) is not None

    for service, info in stack.containers().items():
        config, host = info["Config"], info["HostConfig"]
        assert host["CapDrop"] == ["ALL"], service
        assert host["Memory"] > 0, service
        assert "no-new-privileges:true" in host["SecurityOpt"], service
        if service == "minio-data":  # the one root step: chown of the new volume
            assert host["CapAdd"] == ["CAP_CHOWN"] or host["CapAdd"] == ["CHOWN"], host["CapAdd"]
            continue
        assert config["User"] not in ("", "0", "root", "0:0"), (service, config["User"])


@pytest.mark.timeout(PREPARE_TIMEOUT_S + 4 * STACK_TIMEOUT_S)
def test_stack_publishes_serves_recovers_and_goes_away(stack: Stack) -> None:
    stack.compose("up", "--detach", "--no-build", timeout_s=STACK_TIMEOUT_S)
    assert stack.state("minio-init") == {"status": "exited", "exit": "0", "health": ""}
    assert stack.state("producer")["health"] == "healthy"  # the topic exists

    check_least_privilege(stack)

    # Kill one replica while the trainer is still publishing, once it serves something.
    killed_at = wait_stack(stack, lambda: stack.served("server-1"), "server-1 to serve a version")
    stack.compose("kill", "server-1")
    assert stack.state("server-1")["status"] == "exited"
    wait_stack(
        stack,
        lambda: stack.head() > killed_at or stack.state("trainer")["status"] == "exited",
        f"HEAD to move past v{killed_at} while server-1 is down",
    )
    head_at_restart = stack.head()
    assert head_at_restart > killed_at, (
        f"the trainer published nothing after v{killed_at}: the restart would prove nothing"
    )
    stack.compose("start", "server-1")

    # A live trainer runs until stopped; stop it once it has published three versions, with
    # events still coming.
    wait_stack(stack, lambda: stack.head() >= 3, "the trainer to publish three versions")
    assert stack.state("producer")["status"] == "running", "the replay ended: nothing was live"
    stack.compose("stop", "--timeout", "60", "trainer", timeout_s=120)
    trainer = stack.state("trainer")
    assert (trainer["status"], trainer["exit"]) == ("exited", "0"), stack.compose("logs", "trainer")
    head = stack.head()
    assert head >= 3

    # The trainer announced on Kafka (kafka-python, logged in as `trainer`) and a server's
    # login reads it through the servers' own source, up to HEAD's version.
    heard: set[int] = set()
    with open_source(f"kafka://{stack.kafka}/checknrun.announcements", start="earliest") as bus:
        wait_stack(
            stack,
            lambda: heard.update(json.loads(m)["version"] for m in bus.poll(1.0)) or head in heard,
            f"v{head}'s announcement on the bus",
            timeout_s=60,
        )

    event = stack.first_event()
    never_sent = {**event, "user": "compose-test-no-such-user"}

    for server in SERVERS:
        wait_stack(stack, lambda s=server: stack.served(s) == head, f"{server} to serve v{head}")
        with stack.client(server) as http:
            info = http.get("/v1/model").json()
            assert info["version"] == head
            assert info["id_space"]["mode"] == "dynamic"
            # The first event's user has had a row since the first version; one never sent
            # has none (so the first check is no accident of the response's shape).
            for sent, unknown in ((event, 0), (never_sent, 1)):
                example = raw_example(info["features"], sent)
                r = http.post("/v1/predict", json={"examples": [example]})
                assert r.status_code == 200, r.text
                answer = r.json()
                assert answer["version"] == head
                assert len(answer["scores"]) == 1
                assert answer["unknown_ids"]["user"] == unknown, (example, answer)
    wait_stack(
        stack, lambda: stack.state("server-1")["health"] == "healthy", "server-1 to be healthy"
    )

    # The ACLs are enough: the broker refused nothing the stack's own services asked for, only
    # the server's user writing events, which check_least_privilege tried (and the broker logs).
    denied = {
        (m["principal"], m["resource"])
        for m in re.finditer(
            r"Principal = (?P<principal>\S+) is Denied operation = \w+ .*?"
            r"on resource = (?P<resource>\S+)",
            stack.compose("logs", "--no-log-prefix", "kafka", timeout_s=60),
        )
    }
    assert denied == {("User:server", f"Topic:LITERAL:{EVENTS_TOPIC}")}, denied

    stack.compose("down", "-v", "--timeout", "20")
    assert stack.docker("ps", "--all", "--quiet") == ""
    assert stack.docker("volume", "ls", "--quiet") == ""
    networks = stack.docker("network", "ls", "-q", "--filter", "label=com.docker.compose.project")
    assert networks == ""
