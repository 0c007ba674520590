"""The embedded store: a local directory (`file:///path`).

Writes go to a temporary file in the target directory, are fsynced, renamed over the key's path
and the directory is fsynced, so a crash leaves either the old object or the new one. Conditional
writes (`put_if`) hold an exclusive `flock` on a per-key lock file, which serialises writers across
processes on this machine; the ETag is the file's (inode, size, mtime_ns), which a rename changes.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

from publisher.store.base import (
    NotFoundError,
    ObjectInfo,
    ObjectStore,
    PreconditionFailedError,
    StoreError,
    check_key,
    read_capped,
)

_LOCK_DIR = ".checknrun-locks"
_TMP_PREFIX = ".tmp-"


def _etag(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"


class FileStore(ObjectStore):
    """Objects as files under `root`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()
        self.url = f"file://{self.root}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store directory {self.root}: {exc}") from exc

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put(self, key: str, data: bytes) -> str:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f"{_TMP_PREFIX}{path.name}.{os.getpid()}.{os.urandom(4).hex()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"cannot write {key}: {exc}") from exc
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return _etag(path.stat())

    def put_if(self, key: str, data: bytes, *, etag: str | None) -> str:
        path = self._path(key)
        lock_dir = self.root / _LOCK_DIR
        lock_dir.mkdir(exist_ok=True)
        lock_path = lock_dir / hashlib.sha256(key.encode()).hexdigest()
        with open(lock_path, "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                current = _etag(path.stat())
            except FileNotFoundError:
                current = None
            if current != etag:
                want = "absent" if etag is None else f"ETag {etag}"
                have = "absent" if current is None else f"ETag {current}"
                raise PreconditionFailedError(f"{key}: expected {want}, found {have}")
            return self.put(key, data)

    def get_with_etag(self, key: str, max_bytes: int | None = None) -> tuple[bytes, str]:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                return read_capped(key, f.read, max_bytes, st.st_size), _etag(st)
        except FileNotFoundError as exc:
            raise NotFoundError(f"{key} not found in {self.url}") from exc
        except OSError as exc:
            raise StoreError(f"cannot read {key}: {exc}") from exc

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise StoreError(f"bad range start={start} length={length}")
        try:
            with open(self._path(key), "rb") as f:
                # Clamp to the file: read(n) would allocate n bytes up front, and n may come
                # from a hostile manifest.
                length = max(0, min(length, os.fstat(f.fileno()).st_size - start))
                f.seek(start)
                return f.read(length)
        except FileNotFoundError as exc:
            raise NotFoundError(f"{key} not found in {self.url}") from exc

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        found: list[ObjectInfo] = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if d != _LOCK_DIR]
            for name in filenames:
                if name.startswith(_TMP_PREFIX):
                    continue
                full = Path(dirpath) / name
                key = full.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    try:
                        st = full.stat()
                    except FileNotFoundError:
                        continue  # deleted while listing
                    found.append(ObjectInfo(key, st.st_size, _etag(st), st.st_mtime))
        yield from sorted(found, key=lambda info: info.key)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()
