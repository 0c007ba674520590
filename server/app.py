"""`create_app(settings)`: the FastAPI application and the lifespan that owns its resources.

The lifespan opens, in order, the store client, the announcement source, the live model, the
follower and the follow loop, whose `run` goes to a worker thread: it fixes the source's start
(before HEAD is read, so no announcement falls between the bootstrap and the subscription), then
bootstraps, then follows. The lifespan closes them in reverse order, also those already open
when a later one fails to open. The HTTP server answers /healthz at once; /readyz turns 200 when
the bootstrap has finished. A failure of the loop thread is re-raised (and logged) at shutdown,
never lost.
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
from publisher.read.catalog import NoVersionError
from publisher.read.follower import VersionFollower
from publisher.store import StoreUnavailableError, open_store
from server.dependencies import ServerState
from server.errors import NotBootstrappedError, shown_input
from server.feature_problems import MAX_REPORTED_ERRORS, FeatureValidationError
from server.follow_loop import FollowLoop
from server.heap_policy import return_large_blocks
from server.live_model import LiveModel
from server.metrics import ServerMetrics
from server.middleware import BodySizeLimit, RequestMetrics
from server.routes import health, model, predict
from server.settings import ServerSettings

log = logging.getLogger(__name__)

API_DESCRIPTION = """\
Serves a Check-N-Run model that follows the versions a trainer commits to an object store.

* Every prediction is computed against exactly one model version, named in the response.
* `GET /v1/model` tells which version is served, how fresh it is and what the model takes.
* Admin endpoints (pin, unpin, digest) need `Authorization: Bearer <token>`; with no token
  configured they answer 404.
"""


def _bind_gauges(metrics: ServerMetrics, state: ServerState) -> None:
    from server.routes.health import readiness

    def live() -> LiveModel | None:
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


def create_app(settings: ServerSettings) -> FastAPI:
    """The server application for `settings` (nothing is opened before its lifespan starts)."""
    metrics = ServerMetrics()
    state = ServerState(settings=settings, metrics=metrics)
    _bind_gauges(metrics, state)

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
            live = LiveModel(
                store,
                settings.model,
                scheme=settings.consistency,
                metrics=metrics,
                manifest_cache_size=settings.manifest_cache_size,
                memory_budget=MemoryBudget.from_setting(settings.memory_budget_bytes),
                quantized_tables=settings.quantized_tables,
            )
            resources.callback(live.close)
            follower = VersionFollower(  # reads `source`, which `resources` closes
                live.catalog,
                source,
                poll_head_after_s=settings.poll_head_after_s,
                retry_after_error_s=settings.retry_initial_s,
                min_reconcile_interval_s=settings.min_reconcile_interval_s,
            )
            loop = FollowLoop(
                live,
                follower,
                metrics=metrics,
                poll_timeout_s=settings.poll_timeout_s,
                retry_initial_s=settings.retry_initial_s,
                retry_max_s=settings.retry_max_s,
            )
            state.live, state.follower, state.loop = live, follower, loop
            task = asyncio.create_task(asyncio.to_thread(loop.run)) if settings.follow else None
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
                loop.stop()
                live.interrupt()
                try:
                    if task is not None:
                        await asyncio.wait_for(task, timeout=settings.shutdown_timeout_s)
                except Exception:
                    log.exception("the follow loop failed")
                finally:
                    state.live = state.follower = state.loop = None

    app = FastAPI(
        title="checknrun server",
        version="1",
        description=API_DESCRIPTION,
        lifespan=lifespan,
    )
    app.state.server = state
    app.include_router(predict.router)
    app.include_router(model.router)
    app.include_router(health.router)
    _add_error_handlers(app)
    # Added last = outermost: the body cap runs first, and 413s are counted too.
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=metrics)
    return app


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

    @app.exception_handler(StoreUnavailableError)
    async def _store_down(_: Request, exc: StoreUnavailableError) -> JSONResponse:
        return JSONResponse({"detail": f"store unavailable: {exc}"}, status_code=503)
