"""Ray Serve kept live: a deployment serving a model of your own at the newest verified version.

    python -m examples.ray_serve_live --store file:///srv/store --model ranker \\
        --bus file:///srv/store/announcements.log \\
        --model-factory examples.two_tower:build --request-adapter examples.two_tower:requests

    curl -s localhost:8000/ -H 'content-type: application/json' \\
        -d '{"examples": [{"user": "u12", "item": "i7", "history": [3], "categories": [1]}]}'
    {"model": "ranker", "version": 7, "scores": [0.83], "unknown_ids": {"user": 0, "item": 0}}
    curl -s localhost:8000/model
    {"model": "ranker", "version": 7, "architecture": "two_tower", ...}

Or in an application of your own (the replicas must import the factory's and the adapter's
modules: a package installed on every node, or PYTHONPATH in the job's `runtime_env`):

    app = LiveModelDeployment.bind(store, "ranker", model_factory="mymodels:build",
                                   request_adapter="mymodels:requests", bus=bus)
    serve.run(app)        # handle.predict.remote(examples), handle.info.remote() from Python

Every replica follows on its own: a `publisher.read.Subscriber` applying verified versions to a
`ModuleSink` of the factory's module (double buffer: a request never waits for a version being
applied), as N `checknrun serve` replicas do. Nothing is shared between replicas, so each one's
answers name the version they were computed with; replicas converge within one announcement.

The request contract is `checknrun serve --request-adapter`'s (docs/SERVER.md, "Your own
model"), and so is its code: the raw ids of the adapter's `id_features` are made canonical,
mapped with the borrowed copy's id maps (unknown ids take row 0 and are counted in
`unknown_ids`), and scored, all under one `sink.reader()`, by `server.predictors.
AdapterPredictor`; references resolve with `server.plugins.load_callable`. Importing the server
here is no layering problem (examples sit on top of every package, as bench/ does, and nothing
imports them) and one copy of that logic cannot drift from the other.

    status  when
    200     scored: {"model", "version", "scores", "unknown_ids"}
    400     the body is not JSON
    404/405 another path or method
    413     more examples than `max_batch`, or a body above `max_body_bytes`
    422     not an object holding a non-empty list `examples` (and nothing else), an invalid
            raw id, an example the adapter refuses (`detail`: FastAPI's shape for these two)
    500     the adapter cannot be built for the served version or returns the wrong shape
    503     no version served yet

Every answer but 404/405 carries `model` and `version` (null before the first version).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

from publisher.read import (
    ModuleSink,
    NotBootstrappedError,
    Subscriber,
    SubscriberObserver,
    SubscriberOptions,
    UpdateResult,
    VersionRef,
)
from server.errors import shown_input
from server.feature_problems import FeatureValidationError
from server.plugins import load_callable
from server.predictors import AdapterPredictor, RequestAdapterError

log = logging.getLogger(__name__)

#: the repository root: replicas import `examples` (and the packages, if not installed) from it.
REPO = Path(__file__).resolve().parents[1]


class RequestRefused(Exception):
    """A request this deployment does not score: the HTTP status and the `detail` to answer."""

    def __init__(self, status: int, detail: object) -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail


class ApplyTally(SubscriberObserver):
    """What this replica's applies cost so far (`info()["applies"]`): how many, how long, the
    longest swap pause. Told on the subscriber's thread; read by requests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.plans = 0
        self.versions = 0
        self.seconds = 0.0
        self.max_pause_s = 0.0

    def applied(
        self, plan: Sequence[VersionRef], result: UpdateResult, seconds: float, kind: str
    ) -> None:
        with self._lock:
            self.plans += 1
            self.versions += len(plan)
            self.seconds += seconds
            self.max_pause_s = max(self.max_pause_s, result.pause_s)

    def as_json(self) -> dict[str, Any]:
        with self._lock:
            return {
                "plans": self.plans,
                "versions": self.versions,
                "seconds": round(self.seconds, 6),
                "max_pause_s": round(self.max_pause_s, 6),
            }


class LiveModelReplica:
    """One replica: a subscriber keeping `model` of `store` live, and its answers (see the
    module docstring). `model_factory` / `request_adapter` are `MODULE:FUNCTION` references, as
    `checknrun serve --model-factory` / `--request-adapter` take them. A plain class, usable
    without Ray; `LiveModelDeployment` is its Ray Serve deployment."""

    def __init__(
        self,
        store: str,
        model: str,
        *,
        model_factory: str,
        request_adapter: str,
        bus: str | None = None,
        poll_head_after_s: float = 5.0,
        max_batch: int = 1024,
        max_body_bytes: int = 1024 * 1024,
    ) -> None:
        # Resolved before anything is opened: a bad reference fails the replica's start, as
        # `serve` refuses to start, with the message naming it.
        factory = load_callable(model_factory, "--model-factory")
        self.predictor = AdapterPredictor(load_callable(request_adapter, "--request-adapter"))
        self.max_batch = max_batch
        self.max_body_bytes = max_body_bytes
        self.sink = ModuleSink(factory)
        options = SubscriberOptions(poll_head_after_s=poll_head_after_s)
        self.applies = ApplyTally()
        self.subscriber = Subscriber(
            store, model, self.sink, bus=bus, options=options, observer=self.applies
        ).start()
        self._closed = threading.Event()

    # --- what Python callers (DeploymentHandle) and the HTTP handler share ---------------------

    def predict(self, examples: Sequence[object]) -> dict[str, Any]:
        """Scores of `examples` (raw ids as a client sends them) against one served version;
        RequestRefused says why not."""
        if len(examples) > self.max_batch:
            raise RequestRefused(
                413, f"batch of {len(examples)} examples exceeds the cap of {self.max_batch}"
            )
        try:
            scored, served = self.predictor.predict(self.sink, examples, time.time())
        except NotBootstrappedError as exc:
            raise RequestRefused(503, str(exc)) from exc
        except FeatureValidationError as exc:
            raise RequestRefused(422, [p.as_detail() for p in exc.problems]) from exc
        except RequestAdapterError as exc:
            raise RequestRefused(500, str(exc)) from exc
        version = served.version
        return {
            "model": self.subscriber.model_name,
            "version": version,
            "scores": scored.scores.tolist(),
            "unknown_ids": scored.unknown_ids,
        }

    def info(self) -> dict[str, Any]:
        """The served version and how following goes (the version None before the first)."""
        copy = self.sink.current()
        served = None if copy is None else copy.served
        return {
            "model": self.subscriber.model_name,
            "version": None if served is None else served.version,
            "architecture": None if copy is None else copy.model_config.get("architecture"),
            "applied_at": None if served is None else served.applied_at.isoformat(),
            "following": self._following(),
            "applies": self.applies.as_json(),
            "rejected": self.subscriber.rejected,
            "errors": self.subscriber.errors,
            "last_error": self.subscriber.last_error,
        }

    # --- Ray Serve's hooks ---------------------------------------------------------------------

    async def __call__(self, request: Request) -> JSONResponse:
        """HTTP: `POST /` scores `{"examples": [...]}`, `GET /model` is `info()`."""
        root = str(request.scope.get("root_path", ""))
        path = str(request.scope["path"])
        path = (path[len(root) :] if root and path.startswith(root) else path).rstrip("/")
        routes = {"": "POST", "/model": "GET"}
        if path not in routes:
            return JSONResponse({"detail": f"no route {path or '/'}; POST / or GET /model"}, 404)
        if request.method != routes[path]:
            return JSONResponse({"detail": f"{path or '/'} takes {routes[path]}"}, 405)
        if path == "/model":
            return JSONResponse(self.info())
        try:
            examples = _examples_of(await _body(request, self.max_body_bytes))
            # Off the replica's event loop: torch releases the GIL, and health checks and other
            # requests keep being answered while a batch is scored.
            return JSONResponse(await asyncio.to_thread(self.predict, examples))
        except RequestRefused as exc:
            answer = {"detail": exc.detail, "model": self.subscriber.model_name}
            return JSONResponse({**answer, "version": self.sink.version}, exc.status)

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose check raises: one whose subscriber no longer
        follows (its thread ended). Waiting for a first version is healthy."""
        if not self._following():
            raise RuntimeError(
                f"model {self.subscriber.model_name}: the subscriber stopped following "
                f"(serving v{self.sink.version}; last error: {self.subscriber.last_error})"
            )

    def close(self) -> None:
        """Stop following and close what the subscriber opened (re-raising what its thread
        failed with). Idempotent."""
        if not self._closed.is_set():
            self._closed.set()
            self.subscriber.close()

    def __del__(self) -> None:
        # Ray Serve calls __del__ when it stops a replica; a constructor that failed half-way
        # has nothing to close.
        if hasattr(self, "_closed"):
            try:
                self.close()
            except Exception:
                log.exception("closing the subscriber failed")

    def _following(self) -> bool:
        return self.subscriber.following


#: the deployment: `.bind(store, model, model_factory=..., request_adapter=..., bus=...)`;
#: `.options(num_replicas=N, ray_actor_options=...)` as for any deployment.
LiveModelDeployment = serve.deployment(name="live_model", health_check_period_s=5.0)(
    LiveModelReplica
)


async def _body(request: Request, cap: int) -> object:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise RequestRefused(413, f"body of {declared} bytes exceeds the cap of {cap}")
    raw = bytearray()
    async for chunk in request.stream():  # chunked bodies declare no length
        raw += chunk
        if len(raw) > cap:
            raise RequestRefused(413, f"body exceeds the cap of {cap} bytes")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestRefused(400, f"the body is not JSON: {exc}") from exc


def _examples_of(body: object) -> list[object]:
    if not isinstance(body, dict) or not isinstance(body.get("examples"), list):
        raise RequestRefused(422, 'the body is a JSON object {"examples": [...]}')
    unknown = [shown_input(str(k)) for k in body if k != "examples"]
    if unknown:
        raise RequestRefused(422, f"unknown field(s) {unknown[:5]}; a request holds `examples`")
    examples: list[object] = body["examples"]
    if not examples:
        raise RequestRefused(422, "`examples` is empty")
    return examples


# --- the quick start -----------------------------------------------------------------------


def replica_pythonpath() -> str:
    """PYTHONPATH for the replicas: this directory (a user's module beside where the command
    runs, as `serve` finds it), the repository (`examples`), then what was set already."""
    parts = [os.getcwd(), str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    return ":".join(dict.fromkeys(parts))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m examples.ray_serve_live ...`: start Ray and Serve here, deploy, block."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.ray_serve_live",
        description="Serve a model of your own with Ray Serve, kept at its newest version.",
    )
    parser.add_argument("--store", required=True, help="file:///path or s3://bucket/prefix")
    parser.add_argument("--model", required=True, help="the model's name in the store")
    parser.add_argument("--bus", help="file:///path/announcements.log or kafka://host:port/topic")
    parser.add_argument("--model-factory", required=True, help="MODULE:FUNCTION")
    parser.add_argument("--request-adapter", required=True, help="MODULE:FUNCTION")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--address", help="an existing Ray cluster (default: start one here)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    ray.init(
        address=args.address,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": replica_pythonpath()}},
    )
    # SIGTERM (a service manager, `kill`) shuts down as Ctrl-C does, Ray's processes with it;
    # set after ray.init, whose own handler aborts and leaves Ray's agents running.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = LiveModelDeployment.options(num_replicas=args.replicas).bind(
            args.store,
            args.model,
            model_factory=args.model_factory,
            request_adapter=args.request_adapter,
            bus=args.bus,
        )
        handle = serve.run(app, name=args.model, route_prefix="/")
        url = f"http://{args.host}:{args.port}/"
        print(f"ray_serve_live: {args.model} deployed at {url} (GET {url}model)", flush=True)
        reported = None
        while True:  # until Ctrl-C: report each new version one replica serves
            version = handle.info.remote().result()["version"]
            if version is not None and version != reported:
                print(f"ray_serve_live: serving v{version}", flush=True)
                reported = version
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
    finally:
        # A second Ctrl-C would leave Ray's processes behind: shutting down takes seconds.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("ray_serve_live: shutting down", flush=True)
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
