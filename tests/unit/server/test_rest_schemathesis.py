"""Property-based run of the server's own OpenAPI spec (schemathesis): no request makes a 5xx.

A real server (create_app under uvicorn on loopback) serves a small synthetic model from a file
store, with an admin token configured, so the generated requests reach every route: predict with
arbitrary bodies, admin endpoints without a token or with a wrong one (401), metrics and probes.
Run twice: a model of encoded ids, and a model trained from raw events (raw-id predictions).
Bounded: a fixed number of examples per operation and no hypothesis deadline (a shared 2-core
machine makes per-example timings meaningless); the whole module takes well under a minute.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
uvicorn = pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from pydantic import SecretStr  # noqa: E402

from bench.synthetic_live import SyntheticLiveRun  # noqa: E402
from bench.synthetic_run import SyntheticRun, small_config  # noqa: E402
from publisher.store import FileStore  # noqa: E402
from server.app import create_app  # noqa: E402
from server.settings import ServerSettings  # noqa: E402

TOKEN = "schemathesis-admin-token-4b1d"
#: examples per operation: enough to hit every 4xx branch of predict, bounded in time.
MAX_EXAMPLES = 60


def _publish_encoded(store: FileStore) -> Callable[[], None]:
    run = SyntheticRun(store, "m", small_config())
    run.train(2)
    run.publish("full")
    run.train(2)
    run.publish("delta")
    return run.close


def _publish_live(store: FileStore) -> Callable[[], None]:
    run = SyntheticLiveRun(store, "m")
    run.train([{"user": f"u{i}", "item": i, "genres": ["a"], "ts": 1e9 + i} for i in range(8)])
    run.publish()
    run.train([{"user": "u1", "item": "new", "ts": 1e9 + 60}])
    run.publish()
    return run.close


@pytest.fixture(scope="module", params=["encoded", "live"])
def base_url(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[str]:
    root: Path = tmp_path_factory.mktemp("schemathesis")
    store = FileStore(root / "store")
    close_run = (_publish_live if request.param == "live" else _publish_encoded)(store)
    app = create_app(
        ServerSettings(
            store=f"file://{root / 'store'}",
            model="m",
            admin_token=SecretStr(TOKEN),
            poll_timeout_s=0.05,
            poll_head_after_s=0.5,
            max_batch=16,
            max_body_bytes=64 * 1024,
        )
    )
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    import httpx

    while httpx.get(f"{url}/readyz").status_code != 200:
        assert time.monotonic() < deadline, "server did not bootstrap"
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        close_run()


ADMIN_PATHS = ("/v1/model/pin", "/v1/model/unpin", "/v1/model/digest")


def test_no_server_errors(base_url: str) -> None:
    # Driven by hand rather than by schemathesis' pytest plugin, whose fixture mode does not run
    # under this pytest; each operation gets its own bounded hypothesis run.
    api = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/predict", "/v1/model", *ADMIN_PATHS}
    failures: list[str] = []
    calls = 0
    for operation in operations:

        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,  # the same requests every run: a CI failure reproduces locally
            database=None,
        )
        @given(case=operation.as_strategy())
        def check(case: Any) -> None:
            nonlocal calls
            calls += 1
            response = case.call(base_url=base_url)
            problem = None
            if response.status_code >= 500:
                problem = "server error"
            elif case.path in ADMIN_PATHS and response.status_code != 401:
                problem = "admin endpoint answered without the token"  # never sent here
            if problem:
                failures.append(
                    f"{problem}: {case.method} {case.formatted_path} -> "
                    f"{response.status_code} {response.text[:300]}\n{case.as_curl_command()}"
                )

        check()
    assert failures == [], "\n".join(failures[:10])
    print(f"schemathesis: {len(operations)} operations, {calls} requests, no 5xx")
