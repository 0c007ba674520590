"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

from server.api_models import HealthResponse, ReadyResponse
from server.dependencies import MetricsDep, StateDep
from server.metrics import CONTENT_TYPE

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process answers")
def healthz() -> HealthResponse:
    return HealthResponse()


def readiness(state: StateDep) -> ReadyResponse:
    """Ready once a version is served, and (if configured) not too stale unless pinned."""
    live = state.live
    if live is None or live.version is None:
        return ReadyResponse(ready=False, version=None, reason="bootstrapping")
    staleness = live.staleness_s()
    limit = state.settings.ready_max_staleness_s
    if limit is not None and live.pinned is None and staleness > limit:
        return ReadyResponse(
            ready=False,
            version=live.version,
            staleness_s=staleness,
            reason=f"a newer version has waited {staleness:.1f} s (limit {limit:.1f} s)",
        )
    return ReadyResponse(ready=True, version=live.version, staleness_s=staleness)


@router.get(
    "/readyz",
    summary="Readiness: bootstrapped (and fresh enough when a staleness limit is set)",
    responses={503: {"model": ReadyResponse, "description": "not ready; `reason` says why"}},
)
def readyz(state: StateDep) -> JSONResponse:
    ready = readiness(state)
    return JSONResponse(ready.model_dump(), status_code=200 if ready.ready else 503)


@router.get(
    "/metrics",
    summary="Prometheus metrics (text exposition format 0.0.4)",
    response_class=PlainTextResponse,
)
def metrics(metrics: MetricsDep) -> PlainTextResponse:
    return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)
