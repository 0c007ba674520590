"""An S3-compatible store (`s3://BUCKET/PREFIX`) over the `minio` client.

Only plain S3 semantics are used, so MinIO, AWS S3 and other compatible servers all work:

- A store key is relative to the prefix: key `m/HEAD` of `s3://b/p` is object `p/m/HEAD` in bucket
  `b`; `list` strips the prefix again.
- `put` is one PUT (atomic by S3's own rules: readers see the old object or the new one); objects
  larger than `part_size` go up as a multipart upload, whose completion is equally atomic.
- `put_if` is a conditional PUT, the compare-and-swap the commit protocol builds on (FORMAT.md
  section 2): `If-None-Match: *` creates only if absent, `If-Match: "<etag>"` replaces only if
  unchanged. A lost race is answered `412 PreconditionFailed` (or, on AWS, `409
  ConditionalRequestConflict` while a competing conditional write is in flight) and raises
  PreconditionFailedError.

  minio-py 7.2 has no public way to send these headers: `put_object(metadata=...)` renames any
  header it does not know to `X-Amz-Meta-<name>`, which would turn the condition into inert user
  metadata and silently make every write unconditional. So `put_if` calls the client's low-level
  `_put_object`, which signs and sends the headers as given (one single-part PUT, up to S3's 5 GiB
  limit; the records written conditionally are a few hundred bytes). `_check_client` refuses a
  client without it at construction rather than at the first commit.

  An S3 ETag is a digest of the content, so rewriting identical bytes keeps it: a swap against an
  ETag compares content, not write history. That is what the protocol needs, as the records
  swapped (lease, HEAD) name their writer's token and version, so equal bytes mean equal state.
- A writer's store creates its bucket on first use (unless CHECKNRUN_S3_CREATE_BUCKET=0); a
  read-only one (`create=False`: ls, inspect, restore, gc, serve) never does, and a missing
  bucket is StoreMissingError at its first request.
- Transient failures (connection refused/reset, timeouts, 5xx, SlowDown) are retried with capped
  exponential backoff within a bounded number of attempts and total time, then raise
  StoreUnavailableError. The urllib3 pool does no retrying of its own and has short connect
  timeouts, so one unreachable endpoint costs seconds per attempt, not the client's default 5
  minutes x 5 retries.

Credentials never appear in `repr`, log lines or error messages.
"""

from __future__ import annotations

import io
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

import urllib3
from minio import Minio
from minio.error import InvalidResponseError, S3Error, ServerError
from urllib3.util import Retry, Timeout

from publisher.store.base import (
    BadKeyError,
    NotFoundError,
    ObjectInfo,
    ObjectStore,
    PreconditionFailedError,
    StoreError,
    StoreMissingError,
    StoreUnavailableError,
    check_key,
    read_capped,
)
from schemas.store_keys import is_safe_prefix

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: S3 error codes worth retrying: the server is overloaded or restarting, not refusing us.
#: ClientDisconnected (MinIO, HTTP 499) and IncompleteBody come back when a server restarting
#: under an in-flight request lost its body: a fresh attempt sends the whole body again.
_TRANSIENT_CODES = frozenset(
    {
        "ClientDisconnected",
        "IncompleteBody",
        "SlowDown",
        "SlowDownRead",
        "SlowDownWrite",
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "XMinioServerNotInitialized",
        "XMinioStorageFull",
        "OperationAborted",
    }
)
_DENIED_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"}
)
_PRECONDITION_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict"})
_MIN_PART_SIZE = 5 * 1024 * 1024  # S3's minimum for every part but the last
_Page = list[ObjectInfo]  # named outside the class, whose `list` method shadows the builtin
_LIST_PAGE = 1000  # S3's own page size: restarting a listing per page costs no extra requests


def _env(*names: str, environ: Mapping[str, str]) -> str | None:
    """The first of `names` that is set and non-empty."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return value
    return None


def _flag(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise StoreError(f"{name}={value!r}: expected 0 or 1")


@dataclass(frozen=True)
class S3Settings:
    """Where and how to reach an S3-compatible endpoint. `secret_key` never shows in repr."""

    endpoint: str  # host:port, no scheme
    access_key: str | None
    secret_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    secure: bool = True
    region: str | None = None
    create_bucket: bool = True
    #: bytes per part of a multipart upload; objects up to this size go up in one PUT.
    part_size: int = 16 * 1024 * 1024
    #: parts of one object uploaded at once.
    part_concurrency: int = 4
    #: attempts of one operation, including the first.
    max_attempts: int = 6
    #: total seconds spent on one operation's retries before giving up.
    max_retry_s: float = 30.0
    #: first backoff; it doubles per attempt (with jitter) up to `max_backoff_s`.
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 60.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> S3Settings:
        """Settings from CHECKNRUN_S3_* variables, falling back to the AWS_* ones."""
        env = os.environ if environ is None else environ
        endpoint = _env(
            "CHECKNRUN_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", environ=env
        )
        access_key = _env("CHECKNRUN_S3_ACCESS_KEY", "AWS_ACCESS_KEY_ID", environ=env)
        secret_key = _env("CHECKNRUN_S3_SECRET_KEY", "AWS_SECRET_ACCESS_KEY", environ=env)
        session_token = _env("AWS_SESSION_TOKEN", environ=env)
        region = _env("CHECKNRUN_S3_REGION", "AWS_REGION", "AWS_DEFAULT_REGION", environ=env)
        if endpoint is None and access_key is None:
            raise StoreError(
                "no S3 endpoint configured for s3:// URLs: set CHECKNRUN_S3_ENDPOINT (host:port or "
                "http(s)://host:port), CHECKNRUN_S3_ACCESS_KEY and CHECKNRUN_S3_SECRET_KEY (or "
                "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY); optionally "
                "CHECKNRUN_S3_SECURE=0|1, CHECKNRUN_S3_REGION and CHECKNRUN_S3_CREATE_BUCKET=0|1"
            )
        if (access_key is None) != (secret_key is None):
            raise StoreError(
                "S3 credentials are incomplete: set both CHECKNRUN_S3_ACCESS_KEY and "
                "CHECKNRUN_S3_SECRET_KEY (or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
            )
        secure_var = _env("CHECKNRUN_S3_SECURE", environ=env)
        secure = None if secure_var is None else _flag("CHECKNRUN_S3_SECURE", secure_var)
        host, scheme_secure = _split_endpoint(endpoint or "s3.amazonaws.com")
        if secure is not None and scheme_secure is not None and secure != scheme_secure:
            raise StoreError(
                f"CHECKNRUN_S3_SECURE={secure_var} contradicts the endpoint's scheme "
                f"({'https' if scheme_secure else 'http'}://{host})"
            )
        create = _env("CHECKNRUN_S3_CREATE_BUCKET", environ=env)
        return cls(
            endpoint=host,
            access_key=access_key,
            secret_key=secret_key,
            session_token=session_token,
            secure=secure if secure is not None else scheme_secure is not False,
            region=region,
            create_bucket=True if create is None else _flag("CHECKNRUN_S3_CREATE_BUCKET", create),
        )


def _split_endpoint(endpoint: str) -> tuple[str, bool | None]:
    """`host:port` and whether the scheme asked for TLS (None when no scheme was given)."""
    secure: bool | None = None
    for scheme, is_tls in (("https://", True), ("http://", False)):
        if endpoint.lower().startswith(scheme):
            endpoint, secure = endpoint[len(scheme) :], is_tls
            break
    host = endpoint.rstrip("/")
    if not host or "/" in host or "://" in host:
        raise StoreError(
            f"S3 endpoint {endpoint!r} must be host[:port] or http(s)://host[:port], with no path"
        )
    return host, secure


def parse_s3_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of `s3://BUCKET[/PREFIX]`; the prefix has no leading or trailing slash."""
    if not url.startswith("s3://"):
        raise StoreError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    prefix = prefix.strip("/")
    if not bucket:
        raise StoreError(f"{url!r} names no bucket: expected s3://BUCKET/PREFIX")
    if prefix:
        check_key(prefix)  # the same rules as keys: no '..', no empty segments
    return bucket, prefix


class S3Store(ObjectStore):
    """Objects in `bucket` under `prefix/`, through an S3-compatible endpoint."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        settings: S3Settings,
        create: bool = True,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """`create=False` (read-only commands): never create the bucket, whatever the settings."""
        if not bucket:
            raise StoreError("S3Store needs a bucket name")
        prefix = prefix.strip("/")
        if prefix:
            check_key(prefix)
        if settings.part_size < _MIN_PART_SIZE:
            raise StoreError(
                f"part_size {settings.part_size} is below S3's minimum {_MIN_PART_SIZE}"
            )
        self.bucket = bucket
        self.prefix = prefix
        self.settings = settings
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._sleep = sleep
        self._create = create
        self._bucket_ready = not (create and settings.create_bucket)
        self._bucket_lock = threading.Lock()
        # No urllib3 retries: this class retries whole operations itself, with its own bounds;
        # two nested retry loops would multiply the time an outage takes to surface.
        http = urllib3.PoolManager(
            timeout=Timeout(connect=settings.connect_timeout_s, read=settings.read_timeout_s),
            maxsize=max(10, settings.part_concurrency * 2),
            retries=Retry(total=0, connect=0, read=0, redirect=0, status=0, raise_on_status=False),
        )
        self._http = http
        self._client = Minio(
            settings.endpoint,
            access_key=settings.access_key,
            secret_key=settings.secret_key,
            session_token=settings.session_token,
            secure=settings.secure,
            # Known region: the client never asks the server for it (one round trip less, and no
            # GetBucketLocation permission needed).
            region=settings.region or "us-east-1",
            http_client=http,
        )
        _check_client(self._client)

    @classmethod
    def from_url(
        cls, url: str, environ: Mapping[str, str] | None = None, *, create: bool = True
    ) -> S3Store:
        """The store `s3://BUCKET/PREFIX` names, configured from the environment."""
        bucket, prefix = parse_s3_url(url)
        return cls(bucket, prefix, settings=S3Settings.from_env(environ), create=create)

    def with_settings(self, **changes: Any) -> S3Store:
        """A store on the same bucket and prefix with some settings changed (tests, tools)."""
        settings = replace(self.settings, **changes)
        return S3Store(self.bucket, self.prefix, settings=settings, create=self._create)

    def __repr__(self) -> str:
        s = self.settings
        scheme = "https" if s.secure else "http"
        endpoint = f"{scheme}://{s.endpoint}"
        return f"S3Store({self.url!r}, endpoint={endpoint!r}, access_key={s.access_key!r})"

    # --- keys --------------------------------------------------------------------------------

    def _object(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _strip(self, name: str) -> str:
        return name[len(self.prefix) + 1 :] if self.prefix else name

    # --- retries and error mapping -----------------------------------------------------------

    def _call(self, what: str, op: Callable[[], _T]) -> _T:
        """Run `op` with bounded retries of transient failures; map client errors to StoreError."""
        self._ensure_bucket()
        return self._retry(what, op)

    def _retry(self, what: str, op: Callable[[], _T]) -> _T:
        s = self.settings
        deadline = time.monotonic() + s.max_retry_s
        attempt = 0
        while True:
            attempt += 1
            try:
                return op()
            except Exception as exc:
                mapped = self._map_error(what, exc)
                if mapped is None:
                    raise
                if not isinstance(mapped, StoreUnavailableError):
                    raise mapped from exc
                delay = min(s.max_backoff_s, s.backoff_s * 2 ** (attempt - 1))
                delay *= 0.5 + random.random() / 2  # jitter: restarting servers see no stampede
                if attempt >= s.max_attempts or time.monotonic() + delay > deadline:
                    raise StoreUnavailableError(
                        f"{what}: {self._where()} unavailable after {attempt} attempts: {mapped}"
                    ) from exc
                log.warning("%s: %s; retry %d in %.2f s", what, mapped, attempt, delay)
                self._sleep(delay)

    def _where(self) -> str:
        scheme = "https" if self.settings.secure else "http"
        return f"S3 endpoint {scheme}://{self.settings.endpoint} (bucket {self.bucket!r})"

    def _map_error(self, what: str, exc: Exception) -> StoreError | None:
        """The StoreError for a client exception (StoreUnavailableError when worth retrying)."""
        if isinstance(exc, StoreError):
            return exc
        if isinstance(exc, S3Error):
            code = exc.code or ""
            status = getattr(exc.response, "status", 0) or 0
            if code in ("NoSuchKey", "NoSuchObject"):
                return NotFoundError(f"{what}: not found in {self.url}")
            if code in _PRECONDITION_CODES or status == 412:
                return PreconditionFailedError(f"{what}: condition failed ({code or status})")
            if code == "NoSuchBucket":
                # A read-only store never creates it: then the URL is most likely wrong.
                hint = "create it or allow CHECKNRUN_S3_CREATE_BUCKET=1"
                return StoreMissingError(
                    f"{what}: bucket {self.bucket!r} does not exist at {self._where()}; "
                    + (hint if self._create else "check the store URL")
                )
            if code in _DENIED_CODES or status == 403:
                return StoreError(
                    f"{what}: access denied to bucket {self.bucket!r} at {self._where()} ({code}): "
                    "check the credentials and the bucket policy"
                )
            if code in _TRANSIENT_CODES or status >= 500 or status in (429, 499):
                return StoreUnavailableError(f"{code or status}: {exc.message}")
            return StoreError(f"{what}: {self._where()} refused: {code} {exc.message}")
        if isinstance(exc, ServerError):
            if exc.status_code >= 500 or exc.status_code == 429:
                return StoreUnavailableError(f"HTTP {exc.status_code}")
            return StoreError(f"{what}: {self._where()} answered HTTP {exc.status_code}")
        if isinstance(exc, InvalidResponseError):
            # A proxy or a half-started server answering with non-S3 content.
            return StoreUnavailableError(f"invalid response: {str(exc)[:200]}")
        if isinstance(exc, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError):
            return StoreUnavailableError(f"{type(exc).__name__}: {_short(exc)}")
        return None

    def _ensure_bucket(self) -> None:
        if self._bucket_ready:
            return
        with self._bucket_lock:
            if self._bucket_ready:
                return

            def create() -> None:
                if self._client.bucket_exists(self.bucket):
                    return
                try:
                    self._client.make_bucket(self.bucket, location=self.settings.region)
                except S3Error as exc:
                    # Another process created it between the two calls.
                    if exc.code != "BucketAlreadyOwnedByYou":
                        raise
                log.info("created bucket %r at %s", self.bucket, self._where())

            self._retry(f"create bucket {self.bucket!r}", create)
            self._bucket_ready = True

    # --- ObjectStore -------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> str:
        name = self._object(key)

        def op() -> str:
            result = self._client.put_object(
                self.bucket,
                name,
                io.BytesIO(data),
                len(data),
                part_size=self.settings.part_size,
                num_parallel_uploads=self.settings.part_concurrency,
            )
            return _unquote(result.etag)

        return self._call(f"put {key}", op)

    def put_if(self, key: str, data: bytes, *, etag: str | None) -> str:
        name = self._object(key)
        headers = {"If-None-Match": "*"} if etag is None else {"If-Match": f'"{etag}"'}
        headers["Content-Type"] = "application/octet-stream"
        attempts = 0

        def op() -> str:
            nonlocal attempts
            attempts += 1
            try:
                # A fresh dict per attempt: the client adds its signing headers to the one given.
                result = self._client._put_object(self.bucket, name, data, dict(headers))
            except S3Error as exc:
                if etag is not None and exc.code in ("NoSuchKey", "NoSuchObject"):
                    # If-Match on a missing object: S3 answers 404, the contract says "lost".
                    raise PreconditionFailedError(
                        f"conditional put {key}: expected ETag {etag}, found no object"
                    ) from exc
                if attempts > 1 and (exc.code in _PRECONDITION_CODES or _status(exc) == 412):
                    # An earlier attempt may have been applied with its answer lost (a timeout
                    # or reset after the body went out): then the condition now fails against
                    # our own write. Our bytes are unique (a lease or HEAD naming this writer's
                    # token), so finding them there means that write won.
                    won = self._etag_if_content(name, data)
                    if won is not None:
                        return won
                raise
            return _unquote(result.etag)

        return self._call(f"conditional put {key}", op)

    def _etag_if_content(self, name: str, data: bytes) -> str | None:
        try:
            current, current_etag = self._get(name)
        except Exception:
            return None
        return current_etag if current == data else None

    def _get(self, name: str, max_bytes: int | None = None, **kwargs: Any) -> tuple[bytes, str]:
        response = self._client.get_object(self.bucket, name, **kwargs)
        try:
            # Body and ETag come from one response, so they always belong together.
            body = read_capped(name, response.read, max_bytes)
            return body, _unquote(response.headers.get("etag", ""))
        finally:
            response.close()
            response.release_conn()

    def get_with_etag(self, key: str, max_bytes: int | None = None) -> tuple[bytes, str]:
        name = self._object(key)
        return self._call(f"get {key}", lambda: self._get(name, max_bytes))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise StoreError(f"bad range start={start} length={length}")
        name = self._object(key)

        def op() -> bytes:
            if length == 0:
                # S3 has no empty range; the client would read to the end instead.
                self._client.stat_object(self.bucket, name)
                return b""
            try:
                return self._get(name, offset=start, length=length)[0]
            except S3Error as exc:
                if exc.code == "InvalidRange":  # start at or past the end: like a file read
                    return b""
                raise

        return self._call(f"get range {key}", op)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        if not is_safe_prefix(prefix):
            raise BadKeyError(f"unsafe list prefix {prefix!r}")
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        # Pages of `_LIST_PAGE`, each fetched (and retried) on its own: a transient failure
        # mid-listing resumes after the last key yielded instead of starting over, which would
        # yield duplicates.
        after: str | None = None
        while True:
            page, done = self._call(f"list {prefix!r}", partial(self._list_page, full, after))
            yield from page
            if done or not page:
                return
            after = self._object(page[-1].key)

    def _list_page(self, full_prefix: str, after: str | None) -> tuple[_Page, bool]:
        """Up to `_LIST_PAGE` objects after `after`, and whether the listing is complete."""
        page: _Page = []
        objects = self._client.list_objects(
            self.bucket, prefix=full_prefix, recursive=True, start_after=after
        )
        for obj in objects:
            page.append(
                ObjectInfo(
                    key=self._strip(obj.object_name),
                    size=int(obj.size or 0),
                    etag=_unquote(obj.etag or ""),
                    modified=obj.last_modified.timestamp() if obj.last_modified else 0.0,
                )
            )
            if len(page) >= _LIST_PAGE:
                return page, False
        return page, True

    def delete(self, key: str) -> None:
        name = self._object(key)
        self._call(f"delete {key}", lambda: self._client.remove_object(self.bucket, name))

    def exists(self, key: str) -> bool:
        name = self._object(key)

        def op() -> bool:
            try:
                self._client.stat_object(self.bucket, name)
            except S3Error as exc:
                if exc.code in ("NoSuchKey", "NoSuchObject") or _status(exc) == 404:
                    return False
                raise
            return True

        return self._call(f"exists {key}", op)

    def close(self) -> None:
        self._http.clear()


def _status(exc: S3Error) -> int:
    return int(getattr(exc.response, "status", 0) or 0)


def _unquote(etag: str | None) -> str:
    return (etag or "").strip().strip('"')


def _short(exc: BaseException) -> str:
    """The innermost reason of a urllib3 error, without its long retry preamble."""
    reason = getattr(exc, "reason", None)
    text = str(reason if reason is not None else exc)
    return text[:300]


def _check_client(client: Minio) -> None:
    if not callable(getattr(client, "_put_object", None)):
        raise StoreError(
            "this minio client has no _put_object: conditional writes (If-Match / If-None-Match) "
            "cannot be sent; install minio 7.2.x"
        )
