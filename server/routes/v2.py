"""The Open Inference Protocol v2 (KServe / Triton) over REST, beside /v1 (docs/SERVER.md, "The
v2 protocol"): health, server and model metadata, and infer (server/v2_infer.py, the same as
over gRPC). Errors are the protocol's `{"error": ...}`: 400 for a request that breaks the
protocol or the model's inputs, 404 for another model or a version not served, 413 for a batch
over the cap, 503 before the first version.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.dependencies import StateDep
from server.v2_infer import (
    SCORE,
    check_model,
    check_outputs,
    infer,
    is_ready,
    max_elements,
    model_metadata,
)
from server.v2_tensors import V2RequestError, infer_response, parse_infer_request
from server.work_placement import scored_where_cheapest

router = APIRouter(prefix="/v2", tags=["v2"])

HEADER_LENGTH = "Inference-Header-Content-Length"
#: the server metadata (`GET /v2`; gRPC ServerMetadata).
SERVER_METADATA: dict[str, Any] = {
    "name": "checknrun",
    "version": "1",
    "extensions": ["binary_tensor_data"],
}


def v2_error(exc: V2RequestError) -> JSONResponse:
    """The protocol's error body, with the status of the error's kind."""
    return JSONResponse({"error": str(exc)}, status_code=exc.http_status)


@router.get("", summary="v2 server metadata")
def server_metadata() -> dict[str, Any]:
    return SERVER_METADATA


@router.get("/health/live", summary="v2 liveness")
def live() -> Response:
    return Response(status_code=200)


@router.get("/health/ready", summary="v2 readiness: a version is served")
def ready(state: StateDep) -> Response:
    return Response(status_code=200 if is_ready(state) else 503)


@router.get("/models/{name}/ready", summary="v2 model readiness")
def model_ready(name: str, state: StateDep) -> Response:
    try:
        check_model(state, name)
    except V2RequestError as exc:
        return v2_error(exc)
    return ready(state)


@router.get("/models/{name}", summary="v2 model metadata: inputs, outputs, the served version")
def get_model_metadata(name: str, state: StateDep) -> Response:
    try:
        return JSONResponse(model_metadata(state, name))
    except V2RequestError as exc:
        return v2_error(exc)


@router.post("/models/{name}/infer", summary="v2 inference against the served version")
async def infer_served(name: str, request: Request, state: StateDep) -> Response:
    return await _infer(name, None, request, state)


@router.post(
    "/models/{name}/versions/{version}/infer",
    summary="v2 inference answered by that version only",
)
async def infer_version(name: str, version: str, request: Request, state: StateDep) -> Response:
    if not version.isdigit() or len(version) > 12:
        return v2_error(V2RequestError(f"version {version[:16]!r} is not a version number"))
    return await _infer(name, int(version), request, state)


async def _infer(name: str, version: int | None, request: Request, state: StateDep) -> Response:
    try:
        check_model(state, name)
        body = await request.body()
        parsed = parse_infer_request(
            body, _header_length(request.headers.get(HEADER_LENGTH)), max_elements(state)
        )
        check_outputs(parsed.outputs)
        outcome = await scored_where_cheapest(
            len(body), infer, state, name, version, parsed.tensors
        )
    except V2RequestError as exc:
        return v2_error(exc)
    asked = parsed.outputs
    binary = {SCORE: parsed.binary_output or bool(asked and asked.get(SCORE))}
    data, header_length = infer_response(
        model=name,
        version=outcome.version,
        request_id=parsed.id,
        outputs=[(SCORE, outcome.scores)],
        binary=binary,
        parameters=outcome.parameters,
    )
    if header_length is None:
        return Response(data, media_type="application/json")
    return Response(
        data, media_type="application/octet-stream", headers={HEADER_LENGTH: str(header_length)}
    )


def _header_length(value: str | None) -> int | None:
    if value is None:
        return None
    if not value.isdigit() or len(value) > 12:
        raise V2RequestError(f"{HEADER_LENGTH} is a byte count, got {value[:16]!r}")
    return int(value)
