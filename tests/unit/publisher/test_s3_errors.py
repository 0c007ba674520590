"""How S3Store maps the S3 client's errors: what it retries and what it reports at once."""

from __future__ import annotations

import pytest
import urllib3
from minio.error import S3Error

from publisher.store.base import (
    NotFoundError,
    PreconditionFailedError,
    StoreError,
    StoreUnavailableError,
)
from publisher.store.s3_store import S3Settings, S3Store


def _store(sleeps: list[float] | None = None) -> S3Store:
    settings = S3Settings(endpoint="127.0.0.1:9", access_key="a", secret_key="b", secure=False)
    sink = [] if sleeps is None else sleeps
    return S3Store("bucket", "model", settings=settings, create=False, sleep=sink.append)


def _s3_error(code: str, status: int) -> S3Error:
    response = urllib3.HTTPResponse(body=b"", status=status)
    return S3Error(response, code, f"{code} message", "/bucket/key", "req", "host")


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("ClientDisconnected", 499),  # MinIO restarting under an in-flight PUT (CI saw it)
        ("IncompleteBody", 400),
        ("SlowDown", 503),
        ("XMinioServerNotInitialized", 503),
        ("SomethingNew", 502),
        ("SomethingNew", 499),
    ],
)
def test_a_restarting_server_is_retried(code: str, status: int) -> None:
    mapped = _store()._map_error("put k", _s3_error(code, status))
    assert isinstance(mapped, StoreUnavailableError)


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("NoSuchKey", 404, NotFoundError),
        ("PreconditionFailed", 412, PreconditionFailedError),
        ("AccessDenied", 403, StoreError),
        ("InvalidArgument", 400, StoreError),
    ],
)
def test_a_refusal_is_reported_at_once(code: str, status: int, kind: type[StoreError]) -> None:
    mapped = _store()._map_error("put k", _s3_error(code, status))
    assert type(mapped) is kind


def test_a_transient_error_then_success_costs_one_retry() -> None:
    sleeps: list[float] = []
    store = _store(sleeps)
    answers: list[Exception | str] = [_s3_error("ClientDisconnected", 499), "etag"]

    def op() -> str:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert store._retry("put k", op) == "etag"
    assert len(sleeps) == 1 and not answers
