"""S3Store against a real MinIO server: ObjectStore conformance, conditional writes, multipart,
error mapping, and the commit protocol (lease + HEAD compare-and-swap) over S3."""

from __future__ import annotations

import hashlib
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
    BadKeyError,
    ConditionalWritesIgnoredError,
    IntegrityError,
    NotFoundError,
    PreconditionFailedError,
    StoreError,
    StoreMissingError,
    StoreUnavailableError,
    check_conditional_writes,
    open_store,
)
from publisher.store.s3_store import S3Settings, S3Store
from publisher.write.version_writer import (
    HeadConflictError,
    LeaseHeldError,
    TableBlob,
    VersionDraft,
    VersionWriter,
)
from schemas.manifest import Head, Position
from schemas.store_keys import head_key
from server.cli import check_store_exists

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


# --- conformance -------------------------------------------------------------------------------


def test_put_get_range_list_delete(store: S3Store) -> None:
    etag = store.put("m/blobs/a", b"hello world")
    data, etag2 = store.get_with_etag("m/blobs/a")
    assert (data, etag2) == (b"hello world", etag)
    assert store.get_range("m/blobs/a", 6, 5) == b"world"
    assert store.get_range("m/blobs/a", 6, 100) == b"world"  # short at the end
    assert store.get_range("m/blobs/a", 11, 4) == b""  # at the end
    assert store.get_range("m/blobs/a", 50, 4) == b""  # past it, like a file
    assert store.get_range("m/blobs/a", 3, 0) == b""
    store.put("m/blobs/b", b"")
    assert store.get("m/blobs/b") == b""
    store.put("m/HEAD", b"{}")
    store.put("other/x", b"1")
    listed = list(store.list("m/"))
    assert [i.key for i in listed] == ["m/HEAD", "m/blobs/a", "m/blobs/b"]  # prefix stripped
    assert [i.size for i in listed] == [2, 11, 0]
    assert listed[1].etag == etag and listed[1].modified > time.time() - 600
    assert [i.key for i in store.list("m/blobs/")] == ["m/blobs/a", "m/blobs/b"]
    assert len(list(store.list(""))) == 4
    for hostile in ("/m/", "m//", "../", "m/./", "m\\"):  # schemas.store_keys.is_safe_prefix
        with pytest.raises(BadKeyError, match="unsafe list prefix"):
            list(store.list(hostile))
    assert store.exists("m/blobs/a") and not store.exists("m/blobs/zz")
    store.delete("m/blobs/a")
    store.delete("m/blobs/a")  # absent: not an error
    assert not store.exists("m/blobs/a")
    with pytest.raises(NotFoundError):
        store.get("m/blobs/a")
    with pytest.raises(NotFoundError):
        store.get_range("m/blobs/a", 0, 1)
    with pytest.raises(StoreError):
        store.get("../escape")
    # Keys really live under the prefix in the bucket.
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


def test_put_if_create_and_compare_and_swap(store: S3Store) -> None:
    etag = store.put_if("m/LEASE", b"one", etag=None)
    with pytest.raises(PreconditionFailedError):
        store.put_if("m/LEASE", b"two", etag=None)  # exists already
    etag2 = store.put_if("m/LEASE", b"two", etag=etag)
    assert store.get_with_etag("m/LEASE") == (b"two", etag2)
    with pytest.raises(PreconditionFailedError):
        store.put_if("m/LEASE", b"three", etag=etag)  # stale ETag
    with pytest.raises(PreconditionFailedError):
        store.put_if("m/absent", b"x", etag=etag2)  # If-Match on a missing object
    assert store.get("m/LEASE") == b"two"
    store.put("m/LEASE", b"four")  # an unconditional write moves the ETag on too
    with pytest.raises(PreconditionFailedError):
        store.put_if("m/LEASE", b"five", etag=etag2)


@pytest.mark.parametrize("create", [True, False])
def test_racing_conditional_writes_have_one_winner(store: S3Store, create: bool) -> None:
    key = "m/HEAD"
    etag = None if create else store.put(key, b"start")
    barrier = threading.Barrier(8)
    wins: list[int] = []
    losses: list[int] = []

    def race(i: int) -> None:
        barrier.wait()
        try:
            store.put_if(key, f"writer {i}".encode(), etag=etag)
        except PreconditionFailedError:
            losses.append(i)
        else:
            wins.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(losses) == 7
    assert store.get(key) == f"writer {wins[0]}".encode()


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


def test_get_verified_rejects_a_corrupted_object(store: S3Store) -> None:
    data = b"delta blob bytes" * 1000
    sha = hashlib.sha256(data).hexdigest()
    store.put("m/blobs/t.cnrd", data)
    assert store.get_verified("m/blobs/t.cnrd", len(data), sha) == data
    store.put("m/blobs/t.cnrd", data[:-1] + b"X")  # same size, one byte flipped
    with pytest.raises(IntegrityError, match="sha256"):
        store.get_verified("m/blobs/t.cnrd", len(data), sha)
    store.put("m/blobs/t.cnrd", data[:-1])
    with pytest.raises(IntegrityError, match="bytes"):
        store.get_verified("m/blobs/t.cnrd", len(data), sha)


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


# --- the commit protocol on S3 -----------------------------------------------------------------


def draft(kind: str, step: int) -> VersionDraft:
    return VersionDraft(
        kind=kind,  # type: ignore[arg-type]
        relative_to=None if kind == "full" else "parent",
        policy="test",
        position=Position(step=step, samples_seen=step),
        tables=[
            TableBlob("emb.a", 64, 4, "fp32", 64 if kind == "full" else 3, 0, b"a" * (step + 1)),
            TableBlob("emb.b", 16, 4, "fp16", 16 if kind == "full" else 2, 1, b"b" * (step + 2)),
        ],
        dense=b"dense@%d" % step,
        model_config={"arch": "test"},
    )


class LeaselessWriter(VersionWriter):
    """A writer that ignores the lease, as a buggy or partitioned trainer would."""

    def _acquire_lease(self) -> None:
        pass

    def renew_lease(self) -> None:
        pass

    def close(self) -> None:
        self._stop.set()


def test_versions_commit_and_read_back(store: S3Store) -> None:
    kinds = ["full", "delta", "delta", "full", "delta"]
    with VersionWriter(store, "m") as writer:
        refs = [writer.commit(draft(k, i)) for i, k in enumerate(kinds)]
    catalog = Catalog(store, "m")
    assert [r.version for r in catalog.versions()] == [1, 2, 3, 4, 5]
    assert [r.version for r in restore_plan(catalog, 3)] == [1, 2, 3]
    assert [r.version for r in restore_plan(catalog)] == [4, 5]
    for ref in refs:
        for blob in ref.manifest.blobs:
            store.get_verified(blob.key, blob.size, blob.sha256)
    head = Head.from_json(store.get(head_key("m")))
    assert (head.version, head.manifest) == (5, refs[-1].key)


def test_a_second_writer_is_refused_by_the_lease(store: S3Store) -> None:
    with VersionWriter(store, "m") as first:
        first.commit(draft("full", 0))
        with pytest.raises(LeaseHeldError):
            VersionWriter(store, "m", owner="elsewhere:1")
        first.commit(draft("delta", 1))
    with VersionWriter(store, "m", owner="elsewhere:1") as second:  # released: now it may
        assert second.commit(draft("delta", 2)).version == 3


def test_head_compare_and_swap_makes_one_writer_lose(store: S3Store) -> None:
    with VersionWriter(store, "m") as w:
        w.commit(draft("full", 0))
    late = LeaselessWriter(store, "m")
    early = LeaselessWriter(store, "m")

    def interleave(stage: str) -> None:
        if stage == "manifest_written":  # `late` has read HEAD; `early` commits meanwhile
            late.crash_hook = None
            early.commit(draft("delta", 1))

    late.crash_hook = interleave  # type: ignore[assignment]
    with pytest.raises(HeadConflictError):
        late.commit(draft("delta", 1))
    catalog = Catalog(store, "m")
    latest = catalog.latest()
    assert latest is not None and latest.version == 2
    assert latest.key.split("-")[-1] == f"{early.token}.json"


def test_racing_writers_never_move_head_backwards(store: S3Store) -> None:
    with VersionWriter(store, "m") as w:
        w.commit(draft("full", 0))
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(Head.from_json(store.get(head_key("m"))).version)

    committed: list[int] = []
    conflicts: list[int] = []

    def write(i: int) -> None:
        writer = LeaselessWriter(store, "m")
        for step in range(4):
            try:
                committed.append(writer.commit(draft("delta", 10 * i + step)).version)
            except HeadConflictError:
                conflicts.append(i)

    watcher = threading.Thread(target=watch)
    watcher.start()
    writers = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    watcher.join()
    assert conflicts, "four writers racing on one HEAD should have collided at least once"
    assert len(committed) == len(set(committed))  # no version number committed twice
    assert seen == sorted(seen)  # HEAD only ever moved forward
    versions = [r.version for r in Catalog(store, "m").versions()]
    assert versions == list(range(1, 2 + len(committed)))  # a linear chain, no holes


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


def test_minio_enforces_conditional_writes_so_the_probe_passes(store: S3Store) -> None:
    check_conditional_writes(store, "m/probe-test")
    assert list(store.list("")) == []  # the probe object is gone
    with VersionWriter(store, "m") as writer:
        assert writer.commit(draft("full", 0)).version == 1


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
