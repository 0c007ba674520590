"""Predictions: a batch of examples scored against exactly one model version.

The handler is a plain `def`, so FastAPI runs it in its threadpool: torch releases the GIL in
its kernels and the event loop stays free for other requests (and for /healthz).

Examples are checked by the app's predictor (server/predictors.py: the built-in DLRM's request
format, or a user's request adapter) before the model is borrowed, so a reader-writer lock is
held only for what needs the version: the mapping of raw ids with that version's id maps (the
rows and the maps a prediction reads are one version's) and the forward pass.
"""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, HTTPException, Response, status

from server.api_models import ErrorResponse, PredictRequest, PredictResponse
from server.dependencies import LiveModelDep, MetricsDep, PredictorDep, SettingsDep
from server.metrics import ServerMetrics
from server.predictors import Scored

router = APIRouter(prefix="/v1", tags=["predict"])


def _count_ids(metrics: ServerMetrics, scored: Scored) -> None:
    for feature, count in (scored.ids or {}).items():
        metrics.raw_ids.labels(feature).inc(count)
        metrics.unknown_ids.labels(feature).inc((scored.unknown_ids or {}).get(feature, 0))


@router.post(
    "/predict",
    summary="Score a batch of examples",
    response_model=PredictResponse,
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
def predict(
    body: PredictRequest,
    live: LiveModelDep,
    predictor: PredictorDep,
    settings: SettingsDep,
    metrics: MetricsDep,
) -> Response:
    started = time.perf_counter()
    now = time.time()
    if len(body.examples) > settings.max_batch:
        raise HTTPException(
            status.HTTP_413_CONTENT_TOO_LARGE,
            f"batch of {len(body.examples)} examples exceeds the cap of {settings.max_batch}",
        )
    scored, served = predictor.predict(live.sink, body.examples, now)
    scores = scored.scores.tolist()
    metrics.predict_seconds.observe(time.perf_counter() - started)
    metrics.predict_examples.inc(len(scores))
    _count_ids(metrics, scored)
    # Encoded here, not by FastAPI's jsonable_encoder and the response model's validation: the
    # scores are floats the predictor checked finite (the model documents the shape).
    doc: dict[str, object] = {
        "model": served.manifest.model,
        "version": served.version,
        "scores": scores,
    }
    if scored.unknown_ids is not None:
        doc["unknown_ids"] = scored.unknown_ids
    return Response(json.dumps(doc, separators=(",", ":")), media_type="application/json")
