"""`checknrun serve --workers 2` as a real process tree: both request processes serve every
version the apply side swaps in (rows and id maps alike, a model trained from raw events),
scoring as the trainer does; admin actions taken in either process; a worker that dies stops
the server; a one-process scheme that cannot be shared is refused."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc

from bench.child_server import ChildServer, free_port
from bench.synthetic_live import SyntheticLiveRun
from publisher.store import FileStore
from tests.support import wait_for
from tests.unit.server.test_raw_id_api import SPEC, TS, train
from tests.user_model_runs import RUNS

pytestmark = pytest.mark.slow  # a server process tree

TOKEN = "workers-test-token-0123456789abcdef"
EXAMPLES = [
    {"user": "u1", "item": 2, "genres": ["Drama"], "ts": TS, "price": 10.0},
    {"user": "late-user-3", "item": 1, "genres": ["Noir", "Drama"], "ts": TS},
    {"user": "nobody", "item": 3, "ts": TS},
]


def _processes(url: str, want: int, tries: int = 400) -> dict[int, dict[str, Any]]:
    """/v1/model as each of `want` processes answers it, over fresh connections (the kernel
    hands each to one process's accept loop)."""
    seen: dict[int, dict[str, Any]] = {}
    for _ in range(tries):
        info = httpx.get(f"{url}/v1/model", timeout=10).json()
        seen.setdefault(info["process"], info)
        if len(seen) == want:
            return seen
    raise AssertionError(f"only processes {sorted(seen)} answered in {tries} connections")


def _predict_each(url: str, version: int, want: int = 2) -> dict[int, dict[str, Any]]:
    """A prediction answered by each process once every process serves `version`."""
    got: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 60
    while len(got) < want and time.monotonic() < deadline:
        with httpx.Client(base_url=url, timeout=10) as client:  # a new connection
            process = client.get("/v1/model").json()["process"]
            r = client.post("/v1/predict", json={"examples": EXAMPLES})
            assert r.status_code in (200, 503), r.text
            if r.status_code == 200 and r.json()["version"] == version:
                got.setdefault(process, r.json())
    assert len(got) == want, f"processes {sorted(got)} served v{version}"
    return got


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[SyntheticLiveRun, ChildServer]]:
    run = SyntheticLiveRun(FileStore(tmp_path / "store"), "m", spec=SPEC)
    train(run, [f"u{i}" for i in range(6)])
    run.publish()
    env = {**os.environ, "CHECKNRUN_SERVER_ADMIN_TOKEN": TOKEN}
    grpc_port = free_port()
    with ChildServer(
        f"file://{tmp_path / 'store'}",
        "m",
        tmp_path / "serve.log",
        env=env,
        workers="2",
        grpc_port=str(grpc_port),
        poll_head_after="0.2",
    ) as child:
        child.wait_ready()
        child.grpc_port = grpc_port  # type: ignore[attr-defined]
        yield run, child
    run.close()


def test_every_process_serves_each_version_as_the_trainer_scores(
    tree: tuple[SyntheticLiveRun, ChildServer],
) -> None:
    run, child = tree
    infos = _processes(child.url, 2)
    assert {i["version"] for i in infos.values()} == {1}
    for version in (2, 3, 4):
        # new ids every version: the workers' id maps must take the apply side's writes
        train(run, [f"late-user-{version}", "u1", f"other-{version}"], ts=TS + version)
        assert run.publish() == version
        answers = _predict_each(child.url, version)
        want = run.scores(EXAMPLES)
        for process, body in answers.items():
            np.testing.assert_allclose(body["scores"], want, atol=1e-6, err_msg=f"{process}")
            # late-user-3 is known from v3 on, "nobody" never
            assert body["unknown_ids"]["user"] == (2 if version < 3 else 1), (process, body)
    infos = _processes(child.url, 2)
    assert {i["versions_applied"] for i in infos.values()} == {infos[0]["versions_applied"]}
    # each process's own reading: the worker's id maps equal the apply side's
    digests: dict[int, dict[str, Any]] = {}
    for _ in range(400):
        with httpx.Client(base_url=child.url, timeout=10) as client:
            process = client.get("/v1/model").json()["process"]
            admin = {"Authorization": f"Bearer {TOKEN}"}
            digests.setdefault(process, client.get("/v1/model/digest", headers=admin).json())
        if len(digests) == 2:
            break
    assert digests[0] == digests[1] and digests[0]["version"] == 4
    # gRPC: every process binds the one port; fresh channels land on either
    users = np.array([e["user"].encode() for e in EXAMPLES], dtype=object)
    for _ in range(6):
        client = triton_grpc.InferenceServerClient(f"127.0.0.1:{child.grpc_port}")  # type: ignore[attr-defined]
        tensor = triton_grpc.InferInput("user", [3], "BYTES")
        tensor.set_data_from_numpy(users)
        result = client.infer("m", [tensor])
        assert result.get_response().model_version == "4"
        client.close()
    assert any(name.endswith(".id_map") for name in digests[0]["tensors"])


def test_a_pin_taken_in_any_process_holds_in_all(
    tree: tuple[SyntheticLiveRun, ChildServer],
) -> None:
    run, child = tree
    train(run, ["u1", "u2"], ts=TS + 1)
    assert run.publish() == 2
    _predict_each(child.url, 2)
    admin = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(f"{child.url}/v1/model/pin", json={"version": 1}, headers=admin, timeout=30)
    assert r.status_code == 200, r.text
    for info in _processes(child.url, 2).values():
        assert info["pinned_version"] == 1 and info["version"] == 1
    r = httpx.post(f"{child.url}/v1/model/pin", json={"version": 99}, headers=admin, timeout=30)
    assert r.status_code == 404, r.text  # NoVersionError, raised in process 0, in either
    r = httpx.post(f"{child.url}/v1/model/unpin", headers=admin, timeout=30)
    assert r.status_code == 200 and r.json()["was_pinned"] is True
    _predict_each(child.url, 2)


def test_a_worker_that_dies_stops_the_server(tree: tuple[SyntheticLiveRun, ChildServer]) -> None:
    _, child = tree
    children = Path(f"/proc/{child.proc.pid}/task/{child.proc.pid}/children").read_text().split()
    workers = [int(pid) for pid in children]
    assert len(workers) == 1, children  # the apply side serves too: one forked worker
    os.kill(workers[0], signal.SIGKILL)
    wait_for(lambda: child.proc.poll() is not None, timeout_s=60, what="the server to stop")
    assert child.proc.returncode == 1
    assert "worker-1 exited with status -9" in child.log.read_text()


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_the_workers_go_with_the_server(
    tree: tuple[SyntheticLiveRun, ChildServer], how: str
) -> None:
    # SIGTERM: uvicorn re-raises it once the server stopped, ending the process before it stops
    # its workers; SIGKILL: nothing of the server runs. Either way no worker outlives it.
    _, child = tree
    children = Path(f"/proc/{child.proc.pid}/task/{child.proc.pid}/children").read_text().split()
    assert len(children) == 1, children
    (child.stop if how == "stop" else child.kill)()
    wait_for(
        lambda: (
            not Path(f"/proc/{children[0]}").exists()
            or "zombie" in Path(f"/proc/{children[0]}/status").read_text()
        ),
        timeout_s=60,
        what=f"worker {children[0]} to exit after its server's {how}",
    )


def test_workers_need_the_double_buffer(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    child = ChildServer(
        f"file://{tmp_path / 'store'}",
        "m",
        tmp_path / "serve.log",
        workers="2",
        consistency="rwlock",
    )
    wait_for(lambda: child.proc.poll() is not None, timeout_s=60, what="serve to refuse")
    assert child.proc.returncode == 1
    assert "workers > 1 share the double buffer" in child.log.read_text()


@pytest.mark.parametrize("model", sorted(RUNS))
def test_a_model_of_your_own_is_served_by_every_worker(tmp_path: Path, model: str) -> None:
    pytest.importorskip("torchrec")
    run = RUNS[model](f"file://{tmp_path / 'store'}", model, codec="int4")
    run.train(5)
    run.checkpoint()
    examples = run.requests(6)
    try:
        with ChildServer(
            f"file://{tmp_path / 'store'}",
            model,
            tmp_path / "serve.log",
            workers="2",
            model_factory=f"examples.{model}:build",
            request_adapter=f"examples.{model}:requests",
            poll_head_after="0.2",
        ) as child:
            child.wait_ready()
            for version in (1, 2):
                if version == 2:
                    run.train(3)
                    run.checkpoint()
                got: dict[int, dict[str, Any]] = {}
                deadline = time.monotonic() + 60
                while len(got) < 2 and time.monotonic() < deadline:
                    with httpx.Client(base_url=child.url, timeout=10) as client:
                        process = client.get("/v1/model").json()["process"]
                        r = client.post("/v1/predict", json={"examples": examples})
                        assert r.status_code == 200, r.text
                        if r.json()["version"] == version:
                            got.setdefault(process, r.json())
                assert sorted(got) == [0, 1], f"v{version} served by {sorted(got)}"
                assert got[0]["scores"] == got[1]["scores"]  # the same memory, bit for bit
    finally:
        run.close()
