"""Predictions: a batch of examples scored against exactly one model version.

The handler is a plain `def`, so FastAPI runs it in its threadpool: torch releases the GIL in
its kernels and the event loop stays free for other requests (and for /healthz).

Examples are checked before the model is borrowed (a reader-writer lock is then held only for
what needs the version): for a model of encoded ids the forward pass; for a model trained from
raw events also the mapping of its ids with that version's id maps (server/raw_ids.py), so the
rows and the maps a prediction reads are one version's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from fastapi import APIRouter, HTTPException, status

from server.api_models import ErrorResponse, PredictRequest, PredictResponse
from server.dependencies import LiveModelDep, MetricsDep, SettingsDep
from server.errors import NotBootstrappedError
from server.feature_batch import FeatureBatch, build_batch, check_scores
from server.metrics import ServerMetrics
from server.model_buffer import ModelBuffer
from server.raw_ids import MappedExamples, RawExamples, parse_raw_examples
from server.settings import ServerSettings

router = APIRouter(prefix="/v1", tags=["predict"])

Checked = FeatureBatch | RawExamples


def _checked(
    examples: Sequence[object], buffer: ModelBuffer, settings: ServerSettings, now: float
) -> Checked:
    """`examples` checked against the model `buffer` holds (raw ids not yet mapped)."""
    if buffer.live is None:
        return build_batch(examples, buffer.config, max_ids_per_bag=settings.max_ids_per_bag)
    return parse_raw_examples(
        examples, buffer.live, now=now, max_ids_per_bag=settings.max_ids_per_bag
    )


def _count_ids(metrics: ServerMetrics, mapped: MappedExamples) -> None:
    for feature, count in mapped.ids.items():
        metrics.raw_ids.inc(count, labels=[feature])
        metrics.unknown_ids.inc(mapped.unknown_ids[feature], labels=[feature])


@router.post(
    "/predict",
    summary="Score a batch of examples",
    response_model_exclude_none=True,
    responses={
        413: {"model": ErrorResponse, "description": "body or batch above the server's cap"},
        422: {
            "model": ErrorResponse,
            "description": "invalid body: unknown or missing feature, id outside its table, "
            'wrong type; `detail[].loc` is ["body", "examples", index, feature]; or an example '
            "the model gives no finite score (type `score_not_finite`, its values overflow). "
            "A model trained from raw events: an unknown name, an id that is not a string or "
            "integer of 1 to 256 UTF-8 bytes (`bad_id`), a bag that is not a list or too long, "
            "a `ts` that is not finite unix seconds >= 0 (`bad_ts`)",
        },
        503: {"model": ErrorResponse, "description": "no version is served yet"},
    },
)
def predict(
    body: PredictRequest, live: LiveModelDep, settings: SettingsDep, metrics: MetricsDep
) -> PredictResponse:
    started = time.perf_counter()
    now = time.time()
    if len(body.examples) > settings.max_batch:
        raise HTTPException(
            status.HTTP_413_CONTENT_TOO_LARGE,
            f"batch of {len(body.examples)} examples exceeds the cap of {settings.max_batch}",
        )
    current = live.slot.current()
    if current is None:
        raise NotBootstrappedError("no version is served yet")
    # Checked before borrowing the model; again only if the architecture changed in between.
    config = current.config
    checked = _checked(body.examples, current, settings, now)
    mapped: MappedExamples | None = None
    with live.reader() as buffer:
        if buffer.config != config:
            checked = _checked(body.examples, buffer, settings, now)
        if isinstance(checked, RawExamples):
            mapped = checked.to_batch(buffer.id_maps)
            batch = mapped.batch
        else:
            batch = checked
        logits = buffer.forward(batch.dense, batch.sparse)
        served = buffer.served
    assert served is not None
    probabilities = torch.sigmoid(logits)
    check_scores(probabilities, served.version)
    scores = probabilities.tolist()
    metrics.predict_seconds.observe(time.perf_counter() - started)
    metrics.predict_examples.inc(len(scores))
    if mapped is not None:
        _count_ids(metrics, mapped)
    return PredictResponse(
        model=served.manifest.model,
        version=served.version,
        scores=scores,
        unknown_ids=None if mapped is None else mapped.unknown_ids,
    )
