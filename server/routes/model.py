"""The served model: what it is, and the admin actions pin, unpin and digest."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, HTTPException, status

from publisher.id_map import UNKNOWN_ROW
from publisher.read import ModelCopy, NotBootstrappedError, NoVersionError
from publisher.read.live_model import ApplyTimes
from publisher.store import StoreError
from schemas.errors import BadDataError
from server.api_models import (
    ApplyTimesInfo,
    DigestResponse,
    ErrorResponse,
    FeatureInfo,
    IdSpaceInfo,
    IdTableInfo,
    ModelInfo,
    PinRequest,
    ServedLossInfo,
    UnpinResponse,
)
from server.dependencies import AdminDep, LiveModelDep, ServedModel, StateDep
from server.predictors import Predictor

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


def id_space_info(predictor: Predictor, copy: ModelCopy) -> IdSpaceInfo | None:
    """How `copy`'s model maps raw ids (None for a model of encoded ids); O(tables)."""
    space = predictor.id_space(copy)
    if space is None:
        return None
    maps = {feature: copy.id_maps.get(table) for feature, table in space.tables.items()}
    hashed = bool(maps) and all(m is not None and m.hashed for m in maps.values())
    tables = []
    for feature, table in space.tables.items():
        id_map = maps[feature]
        tables.append(
            IdTableInfo(
                feature=feature,
                table=table,
                rows=copy.tables[table].rows if table in copy.tables else 0,
                ids_held=None if id_map is None or id_map.hashed else len(id_map),
                capacity=None if id_map is None or id_map.hashed else id_map.capacity,
            )
        )
    return IdSpaceInfo(
        mode="hash" if hashed else "dynamic",
        unknown_row=None if hashed else UNKNOWN_ROW,
        count_features=list(space.count_features),
        time_features=space.time_features,
        dense_features=dict(space.dense_features),
        tables=tables,
    )


def model_info(live: ServedModel, predictor: Predictor, rejected: int) -> ModelInfo:
    """The /v1/model document of the served version (read under one reader, so the id maps
    described are the served version's)."""
    with live.reader() as copy:
        return _model_info(live, predictor, copy, rejected)


def _model_info(
    live: ServedModel, predictor: Predictor, copy: ModelCopy, rejected: int
) -> ModelInfo:
    if copy.served is None:
        raise NotBootstrappedError("no version is served yet")
    served = copy.served
    m = served.manifest
    features = [
        FeatureInfo(name=f.name, kind=f.kind, rows=f.rows) for f in predictor.features(copy)
    ]
    return ModelInfo(
        model=m.model,
        architecture=str(copy.model_config.get("architecture", "")),
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
        consistency=live.sink.scheme,
        model_memory_bytes=live.nbytes(),
        hashing=predictor.hashing(copy),
        features=features,
        id_space=id_space_info(predictor, copy),
        metrics=dict(m.metrics),
        codecs=sorted({t.codec for t in m.tables}),
        served_loss=None if m.served_loss is None else ServedLossInfo(**m.served_loss.model_dump()),
        last_apply=None if live.last_times is None else apply_times_info(live.last_times),
    )


def apply_times_info(times: ApplyTimes) -> ApplyTimesInfo:
    """`times` as stage durations (microsecond resolution)."""
    fetched_at = times.started_at + times.fetch_s
    return ApplyTimesInfo(
        versions=list(times.versions),
        heard_at=None if times.heard_at is None else datetime.fromtimestamp(times.heard_at, UTC),
        plan_s=_span(times.heard_at, times.planned_at),
        queue_s=_span(times.planned_at, times.started_at),
        fetch_s=round(times.fetch_s, 6),
        write_s=round(max(0.0, times.served_at - fetched_at), 6),
        level_s=round(max(0.0, times.finished_at - times.served_at), 6),
    )


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(max(0.0, end - start), 6)


def _rejected(state: StateDep) -> int:
    return 0 if state.subscriber is None else state.subscriber.rejected


@router.get("", summary="The served model version and its provenance", responses=_NOT_READY)
def get_model(live: LiveModelDep, state: StateDep) -> ModelInfo:
    info = model_info(live, state.predictor, _rejected(state))
    info.process = state.process
    info.track = state.settings.track
    return info


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
        state.metrics.rejected.labels("pin").inc()
        raise HTTPException(
            status.HTTP_502_BAD_GATEWAY,
            f"version {body.version} cannot be served: {type(exc).__name__}: {exc}",
        ) from exc
    except StoreError as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"store: {exc}") from exc
    return model_info(live, state.predictor, _rejected(state))


@router.post(
    "/unpin",
    summary="Admin: follow new versions again (catches up with HEAD in the background)",
    responses=_ADMIN,
)
def unpin(_admin: AdminDep, live: LiveModelDep, state: StateDep) -> UnpinResponse:
    was = live.unpin()
    if state.subscriber is not None:
        state.subscriber.request_catch_up()
    return UnpinResponse(was_pinned=was, version=live.version)


@router.get(
    "/digest",
    summary="Admin: sha256 of every tensor of the served version (compare replicas)",
    responses={**_ADMIN, **_NOT_READY},
)
def digest(_admin: AdminDep, live: LiveModelDep) -> DigestResponse:
    version, tensors = live.digest()
    return DigestResponse(model=live.model_name, version=version, tensors=tensors)
