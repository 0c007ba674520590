"""A helper process of our own, spoken to over a socket pair: the publisher process
(publisher/write/process_publisher.py) and the Kafka event reader
(trainer/streams/kafka_reader.py).

The child is a fresh interpreter running a module (not multiprocessing's spawn, which re-runs the
user's __main__ module; not fork, which would copy torch's thread pools), given its end of the
pair as the file descriptor in argv[1]. Messages are `multiprocessing.connection` objects:
both ends are this code base, never bytes from outside.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any


def start_child(module: str) -> tuple[subprocess.Popen[bytes], Connection]:
    """Start `python -m module FD`; the process and the parent's end of the connection."""
    parent_sock, child_sock = socket.socketpair()
    process = subprocess.Popen(
        [sys.executable, "-m", module, str(child_sock.fileno())],
        pass_fds=(child_sock.fileno(),),
    )
    child_sock.close()
    return process, Connection(parent_sock.detach())


def parent_connection() -> Connection:
    """The child's end, from argv[1] (what `start_child` passed)."""
    return Connection(int(sys.argv[1]))


def receive(
    conn: Connection,
    process: subprocess.Popen[bytes],
    error: Callable[[str], Exception],
    what: str,
) -> tuple[Any, ...]:
    """The child's next reply; `error("the WHAT process died ...")` when the pipe breaks."""
    try:
        reply: tuple[Any, ...] = conn.recv()
    except (EOFError, ConnectionError, OSError) as exc:
        raise error(f"the {what} process died (exit code {process.poll()})") from exc
    return reply
