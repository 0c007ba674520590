"""Predictions: a batch of examples scored against exactly one model version.

The handler is a plain `def`, so FastAPI runs it in its threadpool: torch releases the GIL in
its kernels and the event loop stays free for other requests (and for /healthz).

Examples are checked by the app's predictor (server/predictors.py: the built-in DLRM's request
format, or a user's request adapter) before the model is borrowed, so a reader-writer lock is
held only for what needs the version: the mapping of raw ids with that version's id maps (the
rows and the maps a prediction reads are one version's) and the forward pass.

The body is parsed and checked by pydantic's own JSON parser (`model_validate_json`, Rust: no
Python object per JSON value beyond the ones kept) instead of FastAPI's `json.loads` followed
by validation; the scoring runs where it is cheapest (server/work_placement.py). A columnar
body (`columns`, server/column_request.py) goes the v2 request's way: straight into the model's
batch where the predictor can (a model of encoded ids), else through the examples it holds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from publisher.read import ServedVersion
from server.api_models import ErrorResponse, PredictRequest, PredictResponse
from server.column_request import column_arrays
from server.dependencies import ServerState, StateDep
from server.feature_problems import FeatureProblem, FeatureValidationError
from server.metrics import ServerMetrics
from server.predictors import Scored
from server.v2_infer import max_elements, tensor_examples
from server.v2_tensors import BatchTooLargeError, V2RequestError
from server.work_placement import scored_where_cheapest

router = APIRouter(prefix="/v1", tags=["predict"])


def document_request_body(app: FastAPI) -> None:
    """Put `PredictRequest` in `app`'s OpenAPI components: the handler reads its body itself
    (see the module docstring), so FastAPI does not list the model it is checked with."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = build()
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            schemas["PredictRequest"] = PredictRequest.model_json_schema(
                ref_template="#/components/schemas/{model}"
            )
        return app.openapi_schema or build()

    app.openapi = openapi  # type: ignore[method-assign]


def _count_ids(metrics: ServerMetrics, scored: Scored) -> None:
    for feature, count in (scored.ids or {}).items():
        metrics.raw_ids.labels(feature).inc(count)
        metrics.unknown_ids.labels(feature).inc((scored.unknown_ids or {}).get(feature, 0))


@router.post(
    "/predict",
    summary="Score a batch of examples",
    response_model=PredictResponse,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/PredictRequest"}}
            },
        }
    },
    responses={
        413: {"model": ErrorResponse, "description": "body or batch above the server's cap"},
        422: {
            "model": ErrorResponse,
            "description": "invalid body: unknown or missing feature, id outside its table, "
            'wrong type; `detail[].loc` is ["body", "examples", index, feature]; or an example '
            "the model gives no finite score (type `score_not_finite`, its values overflow). "
            "A model trained from raw events: an unknown name, an id that is not a string or "
            "integer of 1 to 256 UTF-8 bytes (`bad_id`), a bag that is not a list or too long, "
            "a `ts` that is not finite unix seconds >= 0 (`bad_ts`). A model of your own "
            "(`--request-adapter`): a raw id of an id feature that is not valid (`bad_id`), "
            "or what the adapter refused, with its message (`invalid`)",
        },
        500: {
            "model": ErrorResponse,
            "description": "the request adapter could not be built for the served version, "
            "or returned scores of the wrong shape",
        },
        503: {"model": ErrorResponse, "description": "no version is served yet"},
    },
)
async def predict(request: Request, state: StateDep) -> Response:
    started = time.perf_counter()
    now = time.time()
    try:
        data = await request.body()
        body = PredictRequest.model_validate_json(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False)
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None
    live = state.live
    if live is None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "the server is starting")
    settings, predictor, metrics = state.settings, state.predictor, state.metrics
    if body.examples is not None:
        if len(body.examples) > settings.max_batch:
            raise HTTPException(
                status.HTTP_413_CONTENT_TOO_LARGE,
                f"batch of {len(body.examples)} examples exceeds the cap of {settings.max_batch}",
            )
        scored, served = await scored_where_cheapest(
            len(data), predictor.predict, live.sink, body.examples, now
        )
    else:
        assert body.columns is not None
        scored, served = await scored_where_cheapest(len(data), _columns, state, body.columns, now)
    scores = scored.scores.tolist()
    metrics.predict_seconds.observe(time.perf_counter() - started)
    metrics.predict_examples.inc(len(scores))
    _count_ids(metrics, scored)
    # Encoded here, not by FastAPI's jsonable_encoder and the response model's validation: the
    # scores are floats the predictor checked finite (the model documents the shape).
    doc: dict[str, object] = {
        "model": served.manifest.model,
        "version": served.version,
        "track": state.settings.track,
        "scores": scores,
    }
    if scored.unknown_ids is not None:
        doc["unknown_ids"] = scored.unknown_ids
    return Response(json.dumps(doc, separators=(",", ":")), media_type="application/json")


def _columns(
    state: ServerState, columns: Mapping[str, object], now: float
) -> tuple[Scored, ServedVersion]:
    """A columnar body scored: a column that is not one is a 422, too many values a 413."""
    live = state.live
    assert live is not None
    max_batch = state.settings.max_batch
    try:
        arrays = column_arrays(columns, max_elements(state))
        got = state.predictor.predict_columns(live.sink, arrays, now, max_batch=max_batch)
        if got is None:
            got = state.predictor.predict(live.sink, tensor_examples(arrays, max_batch), now)
    except BatchTooLargeError as exc:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, str(exc)) from exc
    except V2RequestError as exc:
        raise FeatureValidationError([FeatureProblem(None, None, str(exc), "invalid")]) from exc
    return got
