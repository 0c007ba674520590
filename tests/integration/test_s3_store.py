"""S3Store against a real MinIO server: what only S3 does (settings, prefixes, paging, multipart,
error mapping, retries, a server that ignores conditions, buckets never created by reads).

What every store must do runs here too, from tests/contracts/test_store_contract.py (its `s3`
parameter).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from publisher.cli import EXIT_ERROR, main
from publisher.read.catalog import Catalog
from publisher.read.planner import restore_plan
from publisher.store import (
    ConditionalWritesIgnoredError,
    PreconditionFailedError,
    StoreError,
    StoreMissingError,
    StoreUnavailableError,
    open_store,
)
from publisher.store.s3_store import S3Settings, S3Store
from publisher.write.version_writer import VersionWriter
from schemas.store_keys import key_version
from server.cli import check_store_exists
from tests.contracts.test_store_contract import draft

MiB = 1024 * 1024


def s3_environ(services: Any) -> dict[str, str]:
    """The CHECKNRUN_S3_* variables that point at the test MinIO."""
    return {
        "CHECKNRUN_S3_ENDPOINT": services.s3_endpoint,
        "CHECKNRUN_S3_ACCESS_KEY": services.s3_access_key,
        "CHECKNRUN_S3_SECRET_KEY": services.s3_secret_key,
        "CHECKNRUN_S3_SECURE": "1" if services.s3_secure else "0",
        "CHECKNRUN_S3_REGION": services.s3_region or "us-east-1",
    }


def fresh_bucket() -> str:
    return f"cnr-test-{uuid.uuid4().hex[:16]}"


def empty(store: S3Store) -> None:
    """Delete what a test left (some tests write tens of MiB)."""
    for info in list(store.list("")):
        store.delete(info.key)


@pytest.fixture
def bucket(unique_name: str) -> str:
    return unique_name


@pytest.fixture
def store(services: Any, bucket: str) -> Iterator[S3Store]:
    s = S3Store.from_url(f"s3://{bucket}/some/prefix", environ=s3_environ(services))
    yield s
    empty(S3Store(bucket, "", settings=s.settings))
    s.close()


# --- configuration -----------------------------------------------------------------------------


def test_settings_from_environment(services: Any) -> None:
    env = s3_environ(services)
    settings = S3Settings.from_env(env)
    assert settings.secure == bool(services.s3_secure)
    assert "://" not in settings.endpoint
    # The AWS names work too, and a scheme on the endpoint sets TLS.
    aws = S3Settings.from_env(
        {
            "AWS_ENDPOINT_URL": "https://s3.example.com:9000",
            "AWS_ACCESS_KEY_ID": "ak",
            "AWS_SECRET_ACCESS_KEY": "sk",
            "AWS_DEFAULT_REGION": "eu-west-1",
        }
    )
    assert (aws.endpoint, aws.secure, aws.region) == ("s3.example.com:9000", True, "eu-west-1")
    with pytest.raises(StoreError, match="CHECKNRUN_S3_ENDPOINT"):
        S3Settings.from_env({})
    with pytest.raises(StoreError, match="CHECKNRUN_S3_SECRET_KEY"):
        S3Settings.from_env({"CHECKNRUN_S3_ENDPOINT": "h:1", "CHECKNRUN_S3_ACCESS_KEY": "a"})
    with pytest.raises(StoreError, match="CHECKNRUN_S3_SECURE"):
        S3Settings.from_env({**env, "CHECKNRUN_S3_SECURE": "maybe"})
    with pytest.raises(StoreError, match="contradicts"):
        S3Settings.from_env(
            {**env, "CHECKNRUN_S3_ENDPOINT": "https://h:1", "CHECKNRUN_S3_SECURE": "0"}
        )
    for bad in ("s3://", "s3:///prefix", "s3://b/../x"):
        with pytest.raises(StoreError):
            S3Store.from_url(bad, environ=env)


def test_repr_and_errors_never_show_the_secret(services: Any, store: S3Store) -> None:
    secret = services.s3_secret_key
    assert secret not in repr(store) and secret not in repr(store.settings)
    wrong = store.with_settings(secret_key="not-" + secret, max_attempts=1)
    with pytest.raises(StoreError) as info:
        wrong.put("m/x", b"1")
    assert store.bucket in str(info.value) and secret not in str(info.value)
    assert "access denied" in str(info.value) or "refused" in str(info.value)


def test_open_store_reads_the_environment(
    services: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3_environ(services).items():
        monkeypatch.setenv(name, value)
    s = open_store(f"s3://{bucket}/p")
    assert isinstance(s, S3Store) and (s.bucket, s.prefix) == (bucket, "p")
    s.put("m/k", b"v")
    assert s.get("m/k") == b"v"


# --- keys, listing and objects on S3 --------------------------------------------------------


def test_keys_live_under_the_prefix_in_the_bucket(store: S3Store) -> None:
    store.put("m/HEAD", b"{}")
    store.put("other/x", b"1")
    assert [i.key for i in store.list("")] == ["m/HEAD", "other/x"]  # the prefix stripped
    bare = S3Store(store.bucket, "", settings=store.settings)
    assert bare.get("some/prefix/m/HEAD") == b"{}"
    assert [i.key for i in bare.list("some/prefix/other/")] == ["some/prefix/other/x"]


def test_list_pages_through_many_objects(store: S3Store) -> None:
    keys = [f"m/many/{i:05d}" for i in range(2345)]

    def put(k: str) -> None:
        store.put(k, b"x")

    threads = [
        threading.Thread(target=lambda ks=keys[i::16]: [put(k) for k in ks]) for i in range(16)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [i.key for i in store.list("m/many/")] == keys


def test_prefixes_are_isolated(services: Any, bucket: str) -> None:
    env = s3_environ(services)
    a = S3Store.from_url(f"s3://{bucket}/a", environ=env)
    b = S3Store.from_url(f"s3://{bucket}/ab", environ=env)
    a.put("m/x", b"a")
    b.put("m/x", b"b")
    assert [i.key for i in a.list("")] == ["m/x"] and a.get("m/x") == b"a"
    assert [i.key for i in b.list("")] == ["m/x"] and b.get("m/x") == b"b"


def test_large_object_goes_multipart(store: S3Store) -> None:
    data = bytes(range(256)) * (20 * MiB // 256)
    etag = store.put("m/blobs/big", data)
    assert "-" in etag  # a multipart ETag is md5-of-part-md5s "-" part count
    assert etag.endswith("-2")  # 20 MiB in 16 MiB parts
    assert store.get("m/blobs/big") == data
    assert store.get_range("m/blobs/big", 16 * MiB - 3, 6) == data[16 * MiB - 3 : 16 * MiB + 3]
    small = store.with_settings(part_size=5 * MiB)
    assert small.put("m/blobs/big5", data).endswith("-4")
    sha = hashlib.sha256(data).hexdigest()
    assert store.get_verified("m/blobs/big5", len(data), sha) == data


def test_bucket_creation_can_be_disallowed(services: Any) -> None:
    env = {**s3_environ(services), "CHECKNRUN_S3_CREATE_BUCKET": "0"}
    name = fresh_bucket()
    s = S3Store.from_url(f"s3://{name}/p", environ=env)
    with pytest.raises(StoreError, match=name) as info:
        s.put("m/x", b"1")
    assert not isinstance(info.value, StoreUnavailableError)
    S3Store.from_url(f"s3://{name}/p", environ=s3_environ(services)).put("m/x", b"1")
    assert s.get("m/x") == b"1"  # exists now


def test_unreachable_endpoint_fails_fast_and_clearly(services: Any) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**s3_environ(services), "CHECKNRUN_S3_ENDPOINT": f"127.0.0.1:{port}"}
    s = S3Store.from_url(f"s3://{fresh_bucket()}/p", environ=env).with_settings(
        max_attempts=3, backoff_s=0.05, connect_timeout_s=1.0
    )
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=f"127.0.0.1:{port}.*after 3 attempts"):
        s.get("m/HEAD")
    assert time.monotonic() - started < 5.0


# --- retries -----------------------------------------------------------------------------------


def test_transient_errors_are_retried_then_reported(store: S3Store) -> None:
    from minio.error import ServerError
    from urllib3.exceptions import ProtocolError

    fast = store.with_settings(backoff_s=0.01, max_attempts=4)
    failures = [ServerError("busy", 503), ProtocolError("connection reset")]

    def flaky() -> str:
        if failures:
            raise failures.pop(0)
        return "done"

    def down() -> None:
        raise ServerError("down", 502)

    def refused() -> None:
        raise ServerError("bad request", 400)

    assert fast._retry("op", flaky) == "done"  # two transient failures, then success
    with pytest.raises(StoreUnavailableError, match="after 4 attempts"):
        fast._retry("op", down)

    with pytest.raises(StoreError) as info:
        fast._retry("op", refused)  # a client error is not retried
    assert not isinstance(info.value, StoreUnavailableError)


def test_conditional_put_whose_answer_was_lost_is_recognised(
    store: S3Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first attempt is applied but its response lost (a read timeout); the retry then
    meets 412 against our own write, which must count as success, not as a lost race."""
    from urllib3.exceptions import ReadTimeoutError

    etag = store.put("m/HEAD", b"v1")
    real = store._client._put_object
    calls = 0
    apply_first = True  # does the first, timed-out attempt reach the server?

    def lossy(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            if apply_first:
                real(*args, **kwargs)
            raise ReadTimeoutError(None, "/", "read timed out")  # type: ignore[arg-type]
        return real(*args, **kwargs)

    monkeypatch.setattr(store._client, "_put_object", lossy)
    won = store.put_if("m/HEAD", b"v2 from writer A", etag=etag)
    assert calls == 2
    assert store.get_with_etag("m/HEAD") == (b"v2 from writer A", won)

    # When the timed-out attempt never landed and another writer's bytes are there, the 412
    # of the retry stands.
    calls, apply_first = 0, False
    with pytest.raises(PreconditionFailedError):
        store.put_if("m/HEAD", b"v3 from writer B", etag=etag)
    assert calls == 2 and store.get("m/HEAD") == b"v2 from writer A"


# --- conditional writes must be enforced (issue 11.9) ------------------------------------------


def test_a_server_that_ignores_conditions_is_refused(
    store: S3Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Older SeaweedFS releases accept If-None-Match / If-Match and ignore them: simulated
    against the real MinIO by a client that drops those headers on the way."""
    real = store._client._put_object

    def deaf(bucket: str, name: str, data: bytes, headers: dict[str, str], *a: Any) -> Any:
        kept = {k: v for k, v in headers.items() if k not in ("If-Match", "If-None-Match")}
        return real(bucket, name, data, kept, *a)

    monkeypatch.setattr(store._client, "_put_object", deaf)
    with pytest.raises(ConditionalWritesIgnoredError, match="ignores conditional writes"):
        VersionWriter(store, "m")
    assert list(store.list("")) == []  # no lease was taken


# --- read-only commands create nothing (issue 11.13) -------------------------------------------


def test_read_only_commands_never_create_a_bucket(
    services: Any,
    minio_client: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    for name, value in s3_environ(services).items():
        monkeypatch.setenv(name, value)
    bucket = fresh_bucket()
    url = f"s3://{bucket}/run1"
    for command, *extra in (["ls"], ["inspect"], ["restore", "--out", str(tmp_path / "m.pt")]):
        assert main([command, "--store", url, "--model", "m", *extra]) == EXIT_ERROR
        assert f"bucket {bucket!r} does not exist" in capsys.readouterr().err
    assert main(["gc", "--store", url, "--model", "m"]) == EXIT_ERROR
    with pytest.raises(StoreMissingError, match="check the store URL"):
        check_store_exists(url, "m")  # `serve` stops here, before it listens
    assert not minio_client.bucket_exists(bucket)
    assert not (tmp_path / "m.pt").exists()


def test_an_existing_bucket_without_the_model(
    services: Any,
    store: S3Store,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in s3_environ(services).items():
        monkeypatch.setenv(name, value)
    store.put("other/HEAD", b"{}")  # the bucket exists and holds another model
    check_store_exists(store.url, "m")  # `serve` starts and waits for the first version
    assert main(["ls", "--store", store.url, "--model", "m"]) == EXIT_ERROR
    assert "holds nothing of it" in capsys.readouterr().err
    with VersionWriter(store, "m") as writer:
        writer.commit(draft("full", 0))
    assert main(["ls", "--store", store.url, "--model", "m", "--json"]) == 0


# --- an unreadable manifest: ls lists past it, gc keeps working ---------------------------------


def test_ls_and_gc_work_past_an_unreadable_manifest(
    services: Any,
    store: S3Store,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in s3_environ(services).items():
        monkeypatch.setenv(name, value)
    with VersionWriter(store, "m") as writer:
        for step, kind in enumerate(["full", "delta", "delta", "full", "delta"]):
            writer.commit(draft(kind, step))  # versions 1..5, fulls at 1 and 4
    (bad,) = (i.key for i in store.list("m/manifests/") if key_version("m", i.key) == 2)
    store.put(bad, store.get(bad)[:-40])  # truncated
    url = ["--store", store.url, "--model", "m"]
    assert main(["ls", *url, "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [r["version"] for r in listing["versions"]] == [3, 4, 5]
    assert [(u["version"], u["manifest"]) for u in listing["unreadable"]] == [(2, bad)]
    assert [r["version"] for r in listing["unverified"]] == [1]
    # One full above it, two kept: the history behind it may be needed, and all of it stays.
    before = {i.key for i in store.list("m/")}
    assert main(["gc", *url, "--keep-baselines", "2", "--grace", "0", "--json"]) == 0
    kept = json.loads(capsys.readouterr().out)
    assert kept["keeps_behind_unreadable"] and kept["keys_deleted"] == 0
    assert [u["manifest"] for u in kept["unreadable"]] == [bad]
    assert {i.key for i in store.list("m/")} == before
    # One kept: it is old history; it and what lies behind it go, the kept chains stay whole.
    assert main(["gc", *url, "--keep-baselines", "1", "--grace", "0", "--json"]) == 0
    dropped = json.loads(capsys.readouterr().out)
    assert dropped["deleted_versions"] == [3] and dropped["kept_versions"] == [4, 5]
    assert not any(key_version("m", i.key) in (1, 2, 3) for i in store.list("m/"))
    catalog = Catalog(store, "m")
    for ref in restore_plan(catalog, 5):
        for blob in ref.manifest.blobs:
            store.get_verified(blob.key, blob.size, blob.sha256)
    assert main(["ls", *url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unreadable"] == []
