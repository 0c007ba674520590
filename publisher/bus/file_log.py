"""The embedded bus: one local append-only log file shared by every model on this machine.

    file:///var/lib/checknrun/announcements.log

Layout: one announcement per line, UTF-8 JSON (which never contains a raw newline) followed by
`\\n`. Writers append under an exclusive `flock` and fsync before unlocking, so lines never
interleave and an announced version survives a power cut. Readers tail the file by byte offset
and hand out complete lines only: a line without its `\\n` yet is left for a later poll.

A writer that crashes mid-append leaves a torn last line. The next writer terminates it with a
`\\n` before appending its own line, so the fragment becomes one bad line (which the follower
drops and counts) instead of corrupting the next announcement.

The log MUST be a regular file: it is opened without following a symbolic link and without
blocking, and anything else at its path (a FIFO, which blocked `open` forever and hung the follow
loop; a symlink; a directory) is refused with a BusError.

The log is never truncated by checknrun; if an operator replaces or truncates it, readers notice
(another inode, a size below their offset, or other bytes at its start than they read there) and
start again from its beginning, like a Kafka consumer whose topic was recreated.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import time
from pathlib import Path

from publisher.bus.base import AnnouncementSource, Announcer, BusError, StartAt
from schemas.announcement import Announcement

log = logging.getLogger(__name__)

#: lines longer than this are not announcements (those are <= 4096 bytes); see FileLogSource.
MAX_LINE_BYTES = 64 * 1024
_READ_CHUNK = 1024 * 1024
_POLL_INTERVAL_S = 0.05
_SIGNATURE_BYTES = 256  # about one announcement: it names a version and a time, so it is unique


class FileLogAnnouncer(Announcer):
    """Appends one model's announcements to the shared log."""

    def __init__(self, path: str | os.PathLike[str], model: str) -> None:
        self.path = Path(path)
        self.model = model
        self.sent = 0
        self.dropped = 0

    def announce(self, announcement: Announcement) -> None:
        self._check_model(announcement)
        line = announcement.to_json() + b"\n"
        try:
            self._append(line)
        except (OSError, BusError) as exc:
            # A full or read-only disk (or no regular file at the path) must not stop training;
            # subscribers poll HEAD.
            self.dropped += 1
            log.warning(
                "cannot append version %d of %s to %s: %s; subscribers will find it in the store",
                announcement.version,
                self.model,
                self.path,
                exc,
            )
            return
        self.sent += 1

    def _append(self, line: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        # Read-write so the lock holder can check the last byte through the same descriptor.
        fd = _open_log(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            size = os.fstat(fd).st_size
            if size > 0 and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line  # terminate a crashed writer's torn line (module docstring)
            _write_all(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)  # closing releases the flock
        if created:
            _fsync_dir(self.path.parent)


class FileLogSource(AnnouncementSource):
    """Tails the shared log from a byte offset; returns every model's lines."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        start: StartAt | int = "latest",
        max_line_bytes: int = MAX_LINE_BYTES,
    ) -> None:
        self.path = Path(path)
        self.max_line_bytes = max_line_bytes
        self._fd: int | None = None
        self._inode: int | None = None
        self._skipping = False  # inside an over-long line: drop bytes up to its newline
        self._signature = b""  # the log's first bytes, to notice it was truncated and rewritten
        self._error: str | None = None
        if isinstance(start, int):
            self.offset = start
        elif start == "earliest":
            self.offset = 0
        else:
            self.offset = self._end_offset()

    def _end_offset(self) -> int:
        """The end of the log's complete lines: taken under a shared lock, so never mid-append."""
        try:
            fd = _open_log(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return 0
        except OSError as exc:
            log.warning(
                "cannot open announcement log %s: %s; reading from its start", self.path, exc
            )
            return 0
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            st = os.fstat(fd)
            self._signature = os.pread(fd, min(st.st_size, _SIGNATURE_BYTES), 0)
            fcntl.flock(fd, fcntl.LOCK_UN)  # explicit: the descriptor stays open for reading
        except OSError:
            os.close(fd)
            raise
        self._fd, self._inode = fd, st.st_ino
        return st.st_size

    def poll(self, timeout_s: float) -> list[bytes]:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            try:
                lines = self._read_lines()
                self._error = None
            except (OSError, BusError) as exc:  # HEAD polls go on meanwhile
                if str(exc) != self._error:  # once per distinct error, not once per 50 ms
                    log.warning("cannot read announcement log %s: %s", self.path, exc)
                    self._error = str(exc)
                lines = []
            if lines:
                return lines
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            time.sleep(min(_POLL_INTERVAL_S, remaining))

    def _open(self) -> int | None:
        """The log's fd, reopened when the file was replaced; None while it does not exist."""
        try:
            st = os.lstat(self.path)  # a symlink put in the log's place is another inode
        except FileNotFoundError:
            self._close_fd()
            return None
        if self._fd is None or st.st_ino != self._inode:
            if self._fd is not None:
                log.warning(
                    "announcement log %s was replaced; reading it from the start", self.path
                )
                self.offset = 0
            self._close_fd()
            self._fd, self._inode = _open_log(self.path, os.O_RDONLY), st.st_ino
            self._skipping, self._signature = False, b""
        if st.st_size < self.offset or (
            self._signature and os.pread(self._fd, len(self._signature), 0) != self._signature
        ):
            log.warning("announcement log %s was truncated; reading it from the start", self.path)
            self.offset, self._skipping, self._signature = 0, False, b""
        return self._fd

    def _read_lines(self) -> list[bytes]:
        fd = self._open()
        if fd is None:
            return []
        chunk = os.pread(fd, _READ_CHUNK, self.offset)
        lines: list[bytes] = []
        pos = 0
        while pos < len(chunk):
            newline = chunk.find(b"\n", pos)
            if newline < 0:
                tail = len(chunk) - pos
                if tail > self.max_line_bytes and not self._skipping:
                    # Hand out a capped prefix so the follower counts it as oversized, then drop
                    # the rest of the line: memory stays bounded whatever the file holds.
                    lines.append(chunk[pos : pos + self.max_line_bytes + 1])
                    self._skipping = True
                if self._skipping:
                    pos = len(chunk)
                break  # an incomplete line: wait until its writer finishes it
            line = chunk[pos:newline]
            pos = newline + 1
            if self._skipping:
                self._skipping = False
                continue
            if len(line) > self.max_line_bytes:
                line = line[: self.max_line_bytes + 1]
            if line.strip():
                lines.append(line)
        self.offset += pos
        if len(self._signature) < min(self.offset, _SIGNATURE_BYTES):
            self._signature = os.pread(fd, min(self.offset, _SIGNATURE_BYTES), 0)
        return lines

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = self._inode = None

    def close(self) -> None:
        self._close_fd()


def _open_log(path: Path, flags: int) -> int:
    """`path` opened with `flags` if it is a regular file; BusError if it is anything else.

    O_NONBLOCK: opening a FIFO for reading otherwise waits for a writer, forever. O_NOFOLLOW: a
    symlink would point the log anywhere. Both are no-ops on the regular file expected here.
    """
    safe = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | safe, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BusError(
                f"announcement log {path} is a symbolic link; expected a regular file"
            ) from exc
        raise
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise BusError(
            f"announcement log {path} is not a regular file (mode {stat.filemode(mode)}); "
            "remove what is there or point the bus URL at a file"
        )
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
