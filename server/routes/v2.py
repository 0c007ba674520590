"""The Open Inference Protocol v2 (KServe / Triton) over REST, beside /v1 (docs/SERVER.md, "The
v2 protocol"): health, server and model metadata, and infer.

One input tensor per feature the served model takes (its `GET /v1/model` features): a single-id
feature as INT64 (encoded ids, or raw integer ids) or BYTES (raw ids; "" is no id), a bag as its
ids flat plus `<name>_lengths` (INT64, one length per example), a dense input as FP32 or FP64
(NaN: missing), and, for a model trained from raw events, an optional `ts` (FP64, unix seconds).
The examples go through the same predictor as /v1/predict, against one version, which the
response names in `model_version`; the one output is `score` (FP32, one per example). Raw-id
counts come back as response parameters `unknown_ids_<feature>`. Errors are `{"error": ...}`:
400 for a request that breaks the protocol or the model's inputs, 404 for another model or a
version not served, 413 for a batch over the cap, 503 before the first version.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from publisher.read import ModelCopy, NotBootstrappedError
from server.dependencies import LiveModelDep, MetricsDep, PredictorDep, SettingsDep, StateDep
from server.feature_problems import FeatureValidationError
from server.predictors import Predictor
from server.v2_tensors import (
    BYTES,
    InferRequest,
    V2RequestError,
    infer_response,
    parse_infer_request,
)

router = APIRouter(prefix="/v2", tags=["v2"])

HEADER_LENGTH = "Inference-Header-Content-Length"
#: the suffix of a bag's lengths tensor.
LENGTHS = "_lengths"
SCORE = "score"


def v2_error(message: str, status: int) -> JSONResponse:
    """The protocol's error body."""
    return JSONResponse({"error": message}, status_code=status)


@router.get("", summary="v2 server metadata")
def server_metadata() -> dict[str, Any]:
    return {"name": "checknrun", "version": "1", "extensions": ["binary_tensor_data"]}


@router.get("/health/live", summary="v2 liveness")
def live() -> Response:
    return Response(status_code=200)


@router.get("/health/ready", summary="v2 readiness: a version is served")
def ready(state: StateDep) -> Response:
    live = state.live
    return Response(status_code=200 if live is not None and live.version is not None else 503)


@router.get("/models/{name}/ready", summary="v2 model readiness")
def model_ready(name: str, state: StateDep, settings: SettingsDep) -> Response:
    if name != settings.model:
        return v2_error(f"unknown model {name!r}; this server serves {settings.model!r}", 404)
    return ready(state)


@router.get("/models/{name}", summary="v2 model metadata: inputs, outputs, the served version")
def model_metadata(
    name: str, live: LiveModelDep, predictor: PredictorDep, settings: SettingsDep
) -> Response:
    if name != settings.model:
        return v2_error(f"unknown model {name!r}; this server serves {settings.model!r}", 404)
    copy = live.sink.current()
    if copy is None or copy.served is None:
        return v2_error("no version is served yet", 503)
    return JSONResponse(
        {
            "name": name,
            "versions": [str(copy.served.version)],
            "platform": "checknrun",
            "inputs": input_metadata(predictor, copy),
            "outputs": [{"name": SCORE, "datatype": "FP32", "shape": [-1]}],
        }
    )


def input_metadata(predictor: Predictor, copy: ModelCopy) -> list[dict[str, Any]]:
    """The model's inputs as v2 tensors (the module docstring's mapping)."""
    raw = predictor.id_space(copy) is not None
    out: list[dict[str, Any]] = []
    for feature in predictor.features(copy):
        if feature.kind == "derived":
            continue
        if feature.kind == "dense":
            out.append({"name": feature.name, "datatype": "FP32", "shape": [-1]})
            continue
        out.append({"name": feature.name, "datatype": BYTES if raw else "INT64", "shape": [-1]})
        if feature.kind == "bag":
            out.append({"name": feature.name + LENGTHS, "datatype": "INT64", "shape": [-1]})
    if raw:
        out.append({"name": "ts", "datatype": "FP64", "shape": [-1]})
    return out


@router.post("/models/{name}/infer", summary="v2 inference against the served version")
async def infer(
    name: str,
    request: Request,
    live: LiveModelDep,
    predictor: PredictorDep,
    settings: SettingsDep,
    metrics: MetricsDep,
) -> Response:
    return await _infer(name, None, request, live, predictor, settings, metrics)


@router.post(
    "/models/{name}/versions/{version}/infer",
    summary="v2 inference answered by that version only",
)
async def infer_version(
    name: str,
    version: str,
    request: Request,
    live: LiveModelDep,
    predictor: PredictorDep,
    settings: SettingsDep,
    metrics: MetricsDep,
) -> Response:
    if not version.isdigit() or len(version) > 12:
        return v2_error(f"version {version[:16]!r} is not a version number", 400)
    return await _infer(name, int(version), request, live, predictor, settings, metrics)


async def _infer(
    name: str,
    version: int | None,
    request: Request,
    live: LiveModelDep,
    predictor: PredictorDep,
    settings: SettingsDep,
    metrics: MetricsDep,
) -> Response:
    if name != settings.model:
        return v2_error(f"unknown model {name!r}; this server serves {settings.model!r}", 404)
    body = await request.body()
    started = time.perf_counter()
    try:
        parsed = parse_infer_request(
            body,
            _header_length(request.headers.get(HEADER_LENGTH)),
            max_elements=settings.max_batch * max(1, settings.max_ids_per_bag),
        )
        examples = tensor_examples(parsed, settings.max_batch)
    except V2RequestError as exc:
        return v2_error(str(exc), 413 if isinstance(exc, BatchTooLargeError) else 400)
    served_now = live.version
    if version is not None and served_now != version:
        return _not_served(version, served_now)
    try:
        scored, served = await run_in_threadpool(
            predictor.predict, live.sink, examples, time.time()
        )
    except FeatureValidationError as exc:
        return v2_error(_problems_text(exc), 400)
    except NotBootstrappedError as exc:
        return v2_error(str(exc), 503)
    if version is not None and served.version != version:  # swapped meanwhile: not that one's
        return _not_served(version, served.version)
    scores = scored.scores.numpy().astype(np.float32)
    metrics.predict_seconds.observe(time.perf_counter() - started)
    metrics.predict_examples.inc(len(scores))
    parameters = {f"unknown_ids_{k}": v for k, v in (scored.unknown_ids or {}).items()}
    asked = parsed.outputs
    if asked is not None and set(asked) - {SCORE}:
        unknown = sorted(set(asked) - {SCORE})
        return v2_error(f"unknown outputs {unknown[:8]}; the model's output is {SCORE!r}", 400)
    binary = {SCORE: parsed.binary_output or bool(asked and asked.get(SCORE))}
    data, header_length = infer_response(
        model=name,
        version=served.version,
        request_id=parsed.id,
        outputs=[(SCORE, scores)],
        binary=binary,
        parameters=parameters,
    )
    if header_length is None:
        return Response(data, media_type="application/json")
    return Response(
        data,
        media_type="application/octet-stream",
        headers={HEADER_LENGTH: str(header_length)},
    )


class BatchTooLargeError(V2RequestError):
    """More examples than the server's cap."""


def tensor_examples(request: InferRequest, max_batch: int) -> list[dict[str, Any]]:
    """The examples the named tensors hold (the module docstring's mapping): one value per
    example of a single tensor, a list per example of a bag (its ids split by its lengths)."""
    tensors = request.tensors
    bags = {
        n[: -len(LENGTHS)] for n in tensors if n.endswith(LENGTHS) and n[: -len(LENGTHS)] in tensors
    }
    batch: int | None = None
    columns: dict[str, list[Any]] = {}
    for name, array in tensors.items():
        if name.endswith(LENGTHS) and name[: -len(LENGTHS)] in bags:
            continue
        if name in bags:
            lengths = tensors[name + LENGTHS]
            if lengths.dtype.kind not in "iu" or lengths.ndim != 1:
                raise V2RequestError(f"input {name + LENGTHS!r} is one integer length per example")
            counts = lengths.astype(np.int64)
            if counts.size and int(counts.min()) < 0:
                raise V2RequestError(f"input {name + LENGTHS!r}: a length is negative")
            flat = array.reshape(-1)
            if int(counts.sum()) != flat.size:
                raise V2RequestError(
                    f"input {name!r}: its lengths add up to {int(counts.sum())}, it holds "
                    f"{flat.size} ids"
                )
            values = _values(flat, name)
            ends = np.cumsum(counts).tolist()
            starts = [0, *ends[:-1]]
            column = [
                [v for v in values[a:b] if v is not None] for a, b in zip(starts, ends, strict=True)
            ]
            rows = len(counts)
        else:
            if not (array.ndim == 1 or (array.ndim == 2 and array.shape[1] == 1)):
                raise V2RequestError(
                    f"input {name!r}: shape {list(array.shape)} is not one value per example "
                    f"([batch] or [batch, 1]); a bag sends {name + LENGTHS!r} beside its ids"
                )
            column = _values(array.reshape(-1), name)
            rows = len(column)
        if batch is None:
            batch = rows
        elif rows != batch:
            raise V2RequestError(f"input {name!r} has {rows} examples, another input {batch}")
        columns[name] = column
    assert batch is not None
    if batch > max_batch:
        raise BatchTooLargeError(f"batch of {batch} examples exceeds the cap of {max_batch}")
    names = list(columns)
    return [{n: v for n in names if (v := columns[n][i]) is not None} for i in range(batch)]


def _values(array: np.ndarray, name: str) -> list[Any]:
    """Python values of a flat array: BYTES as UTF-8 text ("" is none), NaN as none."""
    if array.dtype == object:
        try:
            return [v.decode("utf-8") or None for v in array.tolist()]
        except UnicodeDecodeError as exc:
            raise V2RequestError(f"input {name!r}: an element is not UTF-8 ({exc})") from exc
    values: list[Any] = array.tolist()
    if array.dtype.kind == "f":
        return [None if math.isnan(v) else v for v in values]
    return values


def _header_length(value: str | None) -> int | None:
    if value is None:
        return None
    if not value.isdigit() or len(value) > 12:
        raise V2RequestError(f"{HEADER_LENGTH} is a byte count, got {value[:16]!r}")
    return int(value)


def _not_served(version: int, served: int | None) -> JSONResponse:
    now = "no version yet" if served is None else f"version {served}"
    return v2_error(f"version {version} is not served; this server serves {now}", 404)


def _problems_text(exc: FeatureValidationError) -> str:
    shown = "; ".join(
        f"{p.feature or 'example'}"
        + (f"[{p.example}]" if p.example is not None else "")
        + f": {p.message}"
        for p in exc.problems[:8]
    )
    more = len(exc.problems) - 8
    return shown + (f"; ... and {more} more" if more > 0 else "")
