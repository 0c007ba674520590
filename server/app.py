"""`create_app(settings)`: the FastAPI application and the lifespan that owns its resources.

The served model is the read side's: a `publisher.read.Subscriber` applying versions to a
`ModuleSink` whose factory builds the module of each version's `model_config` (the built-in
DLRM's, or `--model-factory`'s), and a predictor turns requests into its inputs
(server/predictors.py: the DLRM's request format, or `--request-adapter`'s).

The lifespan opens, in order, the store client, the announcement source and the subscriber,
whose `run` goes to a worker thread: it fixes the source's start (before HEAD is read, so no
announcement falls between the bootstrap and the subscription), then bootstraps, then follows.
The lifespan closes them in reverse order, also those already open when a later one fails to
open. The HTTP server answers /healthz at once; /readyz turns 200 when the bootstrap has
finished. A failure of the loop thread is re-raised (and logged) at shutdown, never lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager

import torch
from fastapi import FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from publisher.bus import open_source
from publisher.memory_budget import MemoryBudget
from publisher.read import (
    ModelFactory,
    ModuleSink,
    NotBootstrappedError,
    NoVersionError,
    Subscriber,
    SubscriberOptions,
)
from publisher.read.sinks import dlrm_sink
from publisher.store import StoreUnavailableError, open_store
from server.dependencies import ServedModel, ServerState
from server.errors import shown_input
from server.feature_problems import MAX_REPORTED_ERRORS, FeatureValidationError
from server.heap_policy import return_large_blocks
from server.metrics import MetricsObserver, ServerMetrics
from server.middleware import BodySizeLimit, RequestMetrics
from server.plugins import load_callable
from server.predictors import AdapterPredictor, DLRMPredictor, Predictor, RequestAdapterError
from server.routes import health, model, predict, v2
from server.routes import status as status_page
from server.settings import ServerSettings
from server.workers.links import ApplySideEnds, WorkerEnd
from server.workers.mirror import (
    MirrorLive,
    MirrorSink,
    MirrorSlot,
    RpcClient,
    SyncReceiver,
    WorkerFollower,
)
from server.workers.rpc import ApplySideRpc
from server.workers.shared_slot import SharedDoubleBufferSlot

log = logging.getLogger(__name__)

API_DESCRIPTION = """\
Serves a Check-N-Run model that follows the versions a trainer commits to an object store.

* Every prediction is computed against exactly one model version, named in the response.
* `GET /v1/model` tells which version is served, how fresh it is and what the model takes.
* Admin endpoints (pin, unpin, digest) need `Authorization: Bearer <token>`; with no token
  configured they answer 404.
"""


def subscriber_options(settings: ServerSettings) -> SubscriberOptions:
    """The subscriber's options of the same names as the settings'."""
    return SubscriberOptions(
        poll_timeout_s=settings.poll_timeout_s,
        poll_head_after_s=settings.poll_head_after_s,
        min_reconcile_interval_s=settings.min_reconcile_interval_s,
        retry_initial_s=settings.retry_initial_s,
        retry_max_s=settings.retry_max_s,
        bus_start=settings.bus_start,
        manifest_cache_size=settings.manifest_cache_size,
        track=settings.track,
    )


def _bind_gauges(metrics: ServerMetrics, state: ServerState) -> None:
    from server.routes.health import readiness

    def live() -> ServedModel | None:
        return state.live

    metrics.bind(
        version=lambda: None if (lm := live()) is None else lm.version,
        staleness=lambda: (
            None if (lm := live()) is None or lm.version is None else lm.staleness_s()
        ),
        age=lambda: None if (lm := live()) is None else lm.age_s(),
        pinned=lambda: None if (lm := live()) is None else float(lm.pinned is not None),
        ready=lambda: float(readiness(state).ready),
        model_bytes=lambda: None if (lm := live()) is None else lm.nbytes(),
    )


def served_model(settings: ServerSettings) -> tuple[ModelFactory | None, Predictor]:
    """The model factory (None: the built-in DLRM's) and the predictor `settings` name
    (PluginError for a reference that names no callable)."""
    factory: ModelFactory | None = (
        None
        if settings.model_factory is None
        else load_callable(settings.model_factory, "model factory")
    )
    predictor: Predictor = (
        DLRMPredictor(max_ids_per_bag=settings.max_ids_per_bag)
        if settings.request_adapter is None
        else AdapterPredictor(
            load_callable(settings.request_adapter, "request adapter"),
            max_ids_per_bag=settings.max_ids_per_bag,
        )
    )
    return factory, predictor


def create_app(
    settings: ServerSettings,
    *,
    apply_side: ApplySideEnds | None = None,
    worker: WorkerEnd | None = None,
) -> FastAPI:
    """The server application for `settings` (nothing is opened before its lifespan starts,
    but the model factory and request adapter are imported now: PluginError if they do not).

    With `--workers` (server/workers/): `apply_side` makes this the process that follows the
    versions and shares its copies with the workers; `worker` makes it a worker, serving
    mirrors of them (no store, no bus: the apply side follows)."""
    metrics = ServerMetrics(settings.track)
    factory, predictor = served_model(settings)
    state = ServerState(settings=settings, metrics=metrics, predictor=predictor)
    if worker is not None:
        state.process = worker.gate.index
    _bind_gauges(metrics, state)

    @asynccontextmanager
    async def worker_lifespan(app: FastAPI) -> AsyncIterator[None]:
        assert worker is not None
        torch.set_num_threads(settings.torch_threads)
        slot = MirrorSlot(worker.gate)
        SyncReceiver(slot, worker.control).start()
        state.subscriber = WorkerFollower(
            MirrorLive(settings.model, MirrorSink(slot), RpcClient(worker.rpc))
        )
        with ExitStack() as resources:
            _start_grpc(state, settings, resources)
            try:
                yield
            finally:
                state.subscriber = None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        torch.set_num_threads(settings.torch_threads)
        return_large_blocks()  # before the bootstrap: what a version takes goes back after it
        with ExitStack() as resources:  # closes what was opened, in reverse, even mid-start
            # Read-only: a server never creates the store. A missing directory or bucket fails
            # the start (StoreMissingError); an existing store with no version yet is waited on.
            store = resources.enter_context(open_store(settings.store, create=False))
            source = (
                resources.enter_context(open_source(settings.bus, start=settings.bus_start))
                if settings.bus
                else None
            )
            budget = MemoryBudget.from_setting(settings.memory_budget_bytes)
            scheme, quantized = settings.consistency, settings.quantized_tables
            sink = (
                dlrm_sink(scheme=scheme, quantized=quantized, memory_budget=budget)
                if factory is None
                else ModuleSink(factory, scheme=scheme, quantized=quantized, memory_budget=budget)
            )
            if apply_side is not None:  # the copies every worker process reads
                sink.slot = SharedDoubleBufferSlot.replacing(
                    sink.slot, apply_side.gate, apply_side.pipes
                )
            subscriber = Subscriber(  # reads `store` and `source`, which `resources` closes
                store,
                settings.model,
                sink,
                bus=source,
                options=subscriber_options(settings),
                observer=MetricsObserver(metrics),
            )
            resources.callback(subscriber.close)
            state.subscriber = subscriber
            if apply_side is not None:
                ApplySideRpc(subscriber, apply_side.rpcs).start()
            _start_grpc(state, settings, resources)
            task = (
                asyncio.create_task(asyncio.to_thread(subscriber.run)) if settings.follow else None
            )
            log.info(
                "serving model %s (%s, %s)",
                settings.model,
                settings.consistency,
                "following " + (settings.bus or "HEAD polls")
                if settings.follow
                else "not following",
            )
            try:
                yield
            finally:
                subscriber.stop()
                subscriber.live.interrupt()
                try:
                    if task is not None:
                        await asyncio.wait_for(task, timeout=settings.shutdown_timeout_s)
                except Exception:
                    log.exception("the follow loop failed")
                finally:
                    state.subscriber = None

    app = FastAPI(
        title="checknrun server",
        version="1",
        description=API_DESCRIPTION,
        lifespan=lifespan if worker is None else worker_lifespan,
    )
    app.state.server = state
    app.include_router(predict.router)
    predict.document_request_body(app)
    app.include_router(model.router)
    app.include_router(health.router)
    app.include_router(v2.router)
    app.include_router(status_page.router)
    _add_error_handlers(app)
    # Added last = outermost: the body cap runs first, and 413s are counted too.
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=metrics)
    return app


def _start_grpc(state: ServerState, settings: ServerSettings, resources: ExitStack) -> None:
    """The v2 gRPC server, if `settings` ask for one (grpcio is imported only then)."""
    if settings.grpc_port is None:
        return
    from server.grpc_v2.service import start_grpc

    grpc_server, bound = start_grpc(state, settings.host, settings.grpc_port)
    resources.callback(grpc_server.stop, 1.0)
    state.grpc_port = bound
    log.info("v2 gRPC on %s:%d", settings.host, bound)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes every error's input: unbounded output, and a 500 when
        # that input holds a lone surrogate. Here: the first errors, client text made showable.
        errors = exc.errors()
        detail: list[dict[str, object]] = [
            {
                "loc": [p if isinstance(p, int) else shown_input(str(p)) for p in e["loc"]],
                "msg": shown_input(str(e["msg"]), 300),
                "type": str(e["type"]),
            }
            for e in errors[:MAX_REPORTED_ERRORS]
        ]
        if len(errors) > MAX_REPORTED_ERRORS:
            more = len(errors) - MAX_REPORTED_ERRORS
            detail.append(
                {"loc": ["body"], "msg": f"... and {more} more problems", "type": "too_many"}
            )
        return JSONResponse({"detail": detail}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)

    @app.exception_handler(FeatureValidationError)
    async def _invalid_features(_: Request, exc: FeatureValidationError) -> JSONResponse:
        return JSONResponse(
            {"detail": [p.as_detail() for p in exc.problems]},
            status_code=status.HTTP_422_UNPROCESSABLE_CONTENT,
        )

    @app.exception_handler(NotBootstrappedError)
    async def _not_ready(_: Request, exc: NotBootstrappedError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503)

    @app.exception_handler(NoVersionError)
    async def _no_version(_: Request, exc: NoVersionError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(RequestAdapterError)
    async def _adapter_failed(_: Request, exc: RequestAdapterError) -> JSONResponse:
        log.error("request adapter: %s", exc)
        return JSONResponse({"detail": f"request adapter: {exc}"}, status_code=500)

    @app.exception_handler(StoreUnavailableError)
    async def _store_down(_: Request, exc: StoreUnavailableError) -> JSONResponse:
        return JSONResponse({"detail": f"store unavailable: {exc}"}, status_code=503)
