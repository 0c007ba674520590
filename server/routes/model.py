"""The served model: what it is, and the admin actions pin, unpin and digest."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, status

from publisher.read.catalog import NoVersionError
from publisher.store import StoreError
from schemas.errors import BadDataError
from server.api_models import (
    DigestResponse,
    ErrorResponse,
    FeatureInfo,
    ModelInfo,
    PinRequest,
    UnpinResponse,
)
from server.dependencies import AdminDep, LiveModelDep, StateDep
from server.errors import NotBootstrappedError
from server.live_model import LiveModel

router = APIRouter(prefix="/v1/model", tags=["model"])

_NOT_READY: dict[int | str, dict[str, Any]] = {
    503: {"model": ErrorResponse, "description": "no version is served yet"}
}
_ADMIN: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse, "description": "missing or wrong bearer token"},
    404: {
        "model": ErrorResponse,
        "description": "admin endpoints disabled (no token "
        "configured), or no such committed version",
    },
}


def model_info(live: LiveModel, rejected: int) -> ModelInfo:
    """The /v1/model document of the served version."""
    buffer = live.slot.current()
    if buffer is None or buffer.served is None:
        raise NotBootstrappedError("no version is served yet")
    served = buffer.served
    m = served.manifest
    config = buffer.config
    features = [FeatureInfo(name=d, kind="dense") for d in config.dense]
    features += [
        FeatureInfo(name=f.name, kind="bag" if f.bag else "sparse", rows=f.rows)
        for f in config.sparse
    ]
    return ModelInfo(
        model=m.model,
        version=m.version,
        parent=m.parent,
        kind=m.kind,
        baseline=m.baseline,
        applies_to=m.applies_to,
        policy=m.policy,
        trainer_step=m.position.step,
        samples_seen=m.position.samples_seen,
        created_at=m.created_at,
        applied_at=served.applied_at,
        staleness_s=round(live.staleness_s(), 6),
        age_s=round(live.age_s() or 0.0, 6),
        latest_known_version=live.latest_known(),
        versions_applied=live.versions_applied,
        bytes_fetched=live.bytes_fetched,
        rejected_versions=rejected,
        pinned=live.pinned is not None,
        pinned_version=live.pinned,
        consistency=live.slot.scheme,
        model_memory_bytes=live.nbytes(),
        hashing=config.hashing,
        features=features,
        metrics=dict(m.metrics),
    )


def _rejected(state: StateDep) -> int:
    return 0 if state.loop is None else state.loop.rejected


@router.get("", summary="The served model version and its provenance", responses=_NOT_READY)
def get_model(live: LiveModelDep, state: StateDep) -> ModelInfo:
    return model_info(live, _rejected(state))


@router.post(
    "/pin",
    summary="Admin: serve a committed version (rebuilt from the store) and stop following",
    responses={
        **_ADMIN,
        502: {"model": ErrorResponse, "description": "the version failed verification"},
        503: {"model": ErrorResponse, "description": "store unavailable or not bootstrapped"},
    },
)
def pin(body: PinRequest, _admin: AdminDep, live: LiveModelDep, state: StateDep) -> ModelInfo:
    try:
        live.pin(body.version)
    except NoVersionError as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc
    except BadDataError as exc:
        state.metrics.rejected.inc(labels=["pin"])
        raise HTTPException(
            status.HTTP_502_BAD_GATEWAY,
            f"version {body.version} cannot be served: {type(exc).__name__}: {exc}",
        ) from exc
    except StoreError as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"store: {exc}") from exc
    return model_info(live, _rejected(state))


@router.post(
    "/unpin",
    summary="Admin: follow new versions again (catches up with HEAD in the background)",
    responses=_ADMIN,
)
def unpin(_admin: AdminDep, live: LiveModelDep, state: StateDep) -> UnpinResponse:
    was = live.unpin()
    if state.loop is not None:
        state.loop.request_catch_up()
    return UnpinResponse(was_pinned=was, version=live.version)


@router.get(
    "/digest",
    summary="Admin: sha256 of every tensor of the served version (compare replicas)",
    responses={**_ADMIN, **_NOT_READY},
)
def digest(_admin: AdminDep, live: LiveModelDep) -> DigestResponse:
    version, tensors = live.digest()
    return DigestResponse(model=live.model_name, version=version, tensors=tensors)
