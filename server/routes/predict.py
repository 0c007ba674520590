"""Predictions: a batch of examples scored against exactly one model version.

The handler is a plain `def`, so FastAPI runs it in its threadpool: torch releases the GIL in
its kernels and the event loop stays free for other requests (and for /healthz).
"""

from __future__ import annotations

import time

import torch
from fastapi import APIRouter, HTTPException, status

from server.api_models import ErrorResponse, PredictRequest, PredictResponse
from server.dependencies import LiveModelDep, MetricsDep, SettingsDep
from server.errors import NotBootstrappedError
from server.feature_batch import FeatureBatch, build_batch, check_scores

router = APIRouter(prefix="/v1", tags=["predict"])


@router.post(
    "/predict",
    summary="Score a batch of examples",
    responses={
        413: {"model": ErrorResponse, "description": "body or batch above the server's cap"},
        422: {
            "model": ErrorResponse,
            "description": "invalid body: unknown or missing feature, id outside its table, "
            'wrong type; `detail[].loc` is ["body", "examples", index, feature]; or an example '
            "the model gives no finite score (type `score_not_finite`, its values overflow)",
        },
        503: {"model": ErrorResponse, "description": "no version is served yet"},
    },
)
def predict(
    body: PredictRequest, live: LiveModelDep, settings: SettingsDep, metrics: MetricsDep
) -> PredictResponse:
    started = time.perf_counter()
    if len(body.examples) > settings.max_batch:
        raise HTTPException(
            status.HTTP_413_CONTENT_TOO_LARGE,
            f"batch of {len(body.examples)} examples exceeds the cap of {settings.max_batch}",
        )
    current = live.slot.current()
    if current is None:
        raise NotBootstrappedError("no version is served yet")
    # Validate before borrowing the model (a reader-writer lock is then held only for the
    # forward pass); rebuild only if the architecture changed in between.
    config = current.config
    batch: FeatureBatch = build_batch(
        body.examples, config, max_ids_per_bag=settings.max_ids_per_bag
    )
    with live.reader() as buffer:
        if buffer.config != config:
            batch = build_batch(
                body.examples, buffer.config, max_ids_per_bag=settings.max_ids_per_bag
            )
        logits = buffer.forward(batch.dense, batch.sparse)
        served = buffer.served
    assert served is not None
    probabilities = torch.sigmoid(logits)
    check_scores(probabilities, served.version)
    scores = probabilities.tolist()
    metrics.predict_seconds.observe(time.perf_counter() - started)
    metrics.predict_examples.inc(len(scores))
    return PredictResponse(model=served.manifest.model, version=served.version, scores=scores)
