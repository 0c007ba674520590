"""Child `checknrun serve` processes on loopback (the demo, benchmarks and tests start them): a
free port and the command line.

Ports come from below the kernel's ephemeral range (ip_local_port_range, 32768-60999 by default),
so no outgoing connection can take the port between this check and the child's bind, and below
scripts/services.sh's 20000-31999, where Kafka and MinIO listen.
"""

from __future__ import annotations

import random
import socket
import sys

FREE_PORTS = range(10000, 20000)


def free_port() -> int:
    """A loopback port that nothing listens on now, for a child server to bind."""
    for port in random.sample(FREE_PORTS, 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # all taken (unlikely): an ephemeral port
        s.bind(("127.0.0.1", 0))
        ephemeral: int = s.getsockname()[1]
        return ephemeral


def serve_command(store: str, model: str, port: int, **flags: str | None) -> list[str]:
    """The argv of `checknrun serve` for `store` and `model` on `port`; each flag becomes
    `--flag-name value` (`bus="kafka://..."` -> `--bus kafka://...`), None leaves it out."""
    argv = [sys.executable, "-m", "server.cli", "serve", "--store", store, "--model", model]
    argv += ["--port", str(port)]
    for flag, value in flags.items():
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", value]
    return argv
