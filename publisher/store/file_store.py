"""The embedded store: a local directory (`file:///path`).

Writes go to a temporary file in the target directory, are fsynced, renamed over the key's path
and the directory is fsynced, so a crash leaves either the old object or the new one. Conditional
writes (`put_if`) hold an exclusive `flock` on a per-key lock file, which serialises writers across
processes on this machine; the ETag is the file's (inode, size, mtime_ns), which a rename changes.

Whoever can write into the directory is trusted no more than whoever can send bytes on the bus:
an object is a regular file reached from the root without following a symbolic link. Every
operation walks the key's directories one at a time from the root with `O_NOFOLLOW`, so a planted
link (to /dev/zero, to a directory or file outside the store) is refused with UnsafePathError
instead of being read, written or deleted through. A FIFO, device, socket or directory at a key is
refused the same way; the final open uses `O_NONBLOCK`, so a FIFO cannot hang it before the check.
`list` skips all of them, and `delete` removes a link itself, never what it points to.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import stat
from collections.abc import Iterator
from io import BufferedReader
from pathlib import Path

from publisher.store.base import (
    BadKeyError,
    NotFoundError,
    ObjectInfo,
    ObjectStore,
    PreconditionFailedError,
    StoreError,
    StoreMissingError,
    check_key,
    read_capped,
)
from schemas.errors import BadDataError
from schemas.store_keys import is_safe_prefix

_LOCK_DIR = ".checknrun-locks"
_TMP_PREFIX = ".tmp-"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafePathError(StoreError, BadDataError):
    """A key's path goes through a symbolic link, or ends at something not a regular file."""


def _etag(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"


def _refuse_link(dir_fd: int, name: str, key: str) -> None:
    """UnsafePathError if `name` in `dir_fd` is a symbolic link."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{key}: {name!r} is a symbolic link; the file store follows none")


def _open_dir(dir_fd: int, name: str, key: str) -> int:
    """`name` in `dir_fd` opened as a directory, never through a link.

    FileNotFoundError when it is missing or no directory (the key cannot exist below it).
    """
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        # O_DIRECTORY | O_NOFOLLOW answers ENOTDIR at a link to a directory, as at a file.
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        _refuse_link(dir_fd, name, key)
        raise FileNotFoundError(errno.ENOENT, f"{name!r} in {key!r} is not a directory") from exc


def _open_file(dir_fd: int, name: str, key: str, flags: int) -> int:
    """`name` in `dir_fd` opened with `flags` (which hold O_NOFOLLOW); a link is refused."""
    try:
        return os.open(name, flags, 0o666, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"{key} is a symbolic link; the file store follows none") from exc
        if exc.errno == errno.ENXIO:  # a socket
            raise UnsafePathError(f"{key} is not a regular file") from exc
        raise


def _regular(st: os.stat_result, key: str) -> os.stat_result:
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(f"{key} is not a regular file (mode {stat.filemode(st.st_mode)})")
    return st


class FileStore(ObjectStore):
    """Objects as regular files under `root`."""

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True) -> None:
        """`create=False` (read-only commands): the directory must exist already."""
        self.root = Path(root).resolve()
        self.url = f"file://{self.root}"
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot create store directory {self.root}: {exc}") from exc
        elif not self.root.exists():
            raise StoreMissingError(f"store directory {self.root} does not exist")
        if not self.root.is_dir():
            raise StoreError(f"store {self.url} is not a directory")

    @contextlib.contextmanager
    def _directory(self, key: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
        """The open directory holding `key`, and the key's last segment.

        Walks from the root one segment at a time (making missing directories when `create`).
        FileNotFoundError when a directory on the way is missing; UnsafePathError at a link.
        """
        *dirs, name = check_key(key).split("/")
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for part in dirs:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, dir_fd=fd)
                child = _open_dir(fd, part, key)
                os.close(fd)
                fd = child
            yield fd, name
        finally:
            os.close(fd)

    def _open_object(self, key: str) -> BufferedReader:
        """The regular file at `key`, open for reading."""
        try:
            with self._directory(key) as (dir_fd, name):
                fd = _open_file(dir_fd, name, key, _READ_FLAGS)
        except FileNotFoundError as exc:
            raise NotFoundError(f"{key} not found in {self.url}") from exc
        except OSError as exc:
            raise StoreError(f"cannot read {key}: {exc}") from exc
        try:
            _regular(os.fstat(fd), key)
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb")

    def _stat_object(self, key: str) -> os.stat_result | None:
        """The regular file at `key` (None if absent); UnsafePathError for anything else."""
        try:
            with self._directory(key) as (dir_fd, name):
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot stat {key}: {exc}") from exc
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePathError(f"{key} is a symbolic link; the file store follows none")
        return _regular(st, key)

    def put(self, key: str, data: bytes) -> str:
        try:
            with self._directory(key, create=True) as (dir_fd, name):
                tmp = f"{_TMP_PREFIX}{name}.{os.getpid()}.{os.urandom(4).hex()}"
                fd = os.open(tmp, _CREATE_FLAGS, 0o666, dir_fd=dir_fd)
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    # rename replaces a link at `name` itself, never what it points to.
                    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=dir_fd)
                    raise
                os.fsync(dir_fd)
                return _etag(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
        except OSError as exc:
            raise StoreError(f"cannot write {key}: {exc}") from exc

    def put_if(self, key: str, data: bytes, *, etag: str | None) -> str:
        lock_name = hashlib.sha256(check_key(key).encode()).hexdigest()
        try:
            with self._directory(f"{_LOCK_DIR}/{lock_name}", create=True) as (dir_fd, name):
                lock_fd = _open_file(dir_fd, name, key, _LOCK_FLAGS)
        except OSError as exc:
            raise StoreError(f"cannot lock {key}: {exc}") from exc
        with os.fdopen(lock_fd, "r+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            st = self._stat_object(key)
            current = None if st is None else _etag(st)
            if current != etag:
                want = "absent" if etag is None else f"ETag {etag}"
                have = "absent" if current is None else f"ETag {current}"
                raise PreconditionFailedError(f"{key}: expected {want}, found {have}")
            return self.put(key, data)

    def get_with_etag(self, key: str, max_bytes: int | None = None) -> tuple[bytes, str]:
        try:
            with self._open_object(key) as f:
                st = os.fstat(f.fileno())
                return read_capped(key, f.read, max_bytes, st.st_size), _etag(st)
        except OSError as exc:
            raise StoreError(f"cannot read {key}: {exc}") from exc

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise StoreError(f"bad range start={start} length={length}")
        with self._open_object(key) as f:
            # Clamp to the file: read(n) would allocate n bytes up front, and n may come
            # from a hostile manifest.
            length = max(0, min(length, os.fstat(f.fileno()).st_size - start))
            f.seek(start)
            return f.read(length)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        if not is_safe_prefix(prefix):
            raise BadKeyError(f"unsafe list prefix {prefix!r}")
        found: list[ObjectInfo] = []
        try:
            root_fd = os.open(self.root, _DIR_FLAGS)
        except OSError as exc:
            raise StoreError(f"cannot list {self.url}: {exc}") from exc
        try:
            _scan(root_fd, "", prefix, found)
        finally:
            os.close(root_fd)
        yield from sorted(found, key=lambda info: info.key)

    def delete(self, key: str) -> None:
        try:
            with self._directory(key) as (dir_fd, name):
                os.unlink(name, dir_fd=dir_fd)  # a link goes itself; its target stays
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StoreError(f"cannot delete {key}: {exc}") from exc

    def exists(self, key: str) -> bool:
        return self._stat_object(key) is not None


def _scan(dir_fd: int, rel: str, prefix: str, found: list[ObjectInfo]) -> None:
    """Append the regular files under `dir_fd` whose key starts with `prefix`.

    Symbolic links, FIFOs, devices and sockets are not objects: they are skipped, and a
    directory is entered only through `_open_dir`, never through a link.
    """
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            name, key = entry.name, rel + entry.name
            if name.startswith(_TMP_PREFIX) or name == _LOCK_DIR:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # deleted while listing
            if stat.S_ISDIR(st.st_mode):
                below = key + "/"
                if not (below.startswith(prefix) or prefix.startswith(below)):
                    continue  # no key under it can match
                try:
                    child = _open_dir(dir_fd, name, below)
                except (OSError, UnsafePathError):
                    continue  # gone, or swapped for a link since the scan
                try:
                    _scan(child, below, prefix, found)
                finally:
                    os.close(child)
            elif stat.S_ISREG(st.st_mode) and key.startswith(prefix):
                found.append(ObjectInfo(key, st.st_size, _etag(st), st.st_mtime))
