"""Child `checknrun serve` processes on loopback, for the demo, the benchmarks and the tests.

    with ChildServer(store_url, "movielens", workdir / "server.log", bus=bus_url) as server:
        server.wait_ready()
        server.client.post("/v1/predict", json={"examples": examples})

`ChildServer` starts the server on a free loopback port with the given `serve` flags, its stdout
and stderr going to one log file; `wait_ready` polls until it answers, `client` is an httpx
client bound to its URL, and `stop` (also on leaving the `with` block) sends SIGTERM, then
SIGKILL if it has not exited in time.

Ports come from below the kernel's ephemeral range (ip_local_port_range, 32768-60999 by default),
so no outgoing connection can take the port between this check and the child's bind, and below
scripts/services.sh's 20000-31999, where Kafka and MinIO listen.
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

FREE_PORTS = range(10000, 20000)
#: the repository root: the child runs `python -m server.cli` from there.
REPO = Path(__file__).resolve().parents[1]
#: how much of the log an error quotes.
LOG_TAIL_CHARS = 3000


class ChildServerError(RuntimeError):
    """The child server exited, or did not answer in time; the message quotes its log's end."""


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


class ChildServer:
    """A `checknrun serve` child process on a loopback port, and an httpx client bound to it.

    Starts at construction. `port` 0 picks a free one; `env` replaces the child's environment
    (default: this process's); `flags` are `serve` options as in `serve_command`.
    """

    def __init__(
        self,
        store: str,
        model: str,
        log: Path,
        *,
        port: int = 0,
        env: Mapping[str, str] | None = None,
        **flags: str | None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with log.open("wb") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                serve_command(store, model, self.port, **flags),
                cwd=REPO,
                env=None if env is None else dict(env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.client = httpx.Client(base_url=self.url, timeout=30)

    def __enter__(self) -> ChildServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def log_tail(self) -> str:
        """The end of the child's output."""
        try:
            return self.log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError as exc:
            return f"(log {self.log} unreadable: {exc})"

    def wait_ready(self, timeout_s: float = 120.0, *, path: str = "/readyz") -> float:
        """Poll GET `path` until it answers 200; returns the seconds that took.

        `/readyz` answers once a version is served; `/healthz` as soon as the app is up.
        """
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.proc.poll() is not None:
                raise ChildServerError(
                    f"server on port {self.port} exited with status {self.proc.returncode}; "
                    f"{self.log}:\n{self.log_tail()}"
                )
            try:
                if self.client.get(path, timeout=2).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.1)
        raise ChildServerError(
            f"server on port {self.port}: {path} not 200 after {timeout_s} s; "
            f"{self.log}:\n{self.log_tail()}"
        )

    def info(self) -> dict[str, Any]:
        """GET /v1/model: the served version, its features, counters."""
        data: dict[str, Any] = self.client.get("/v1/model").json()
        return data

    def metrics(self) -> str:
        """GET /metrics: the Prometheus text."""
        return self.client.get("/metrics").text

    def wait_version(self, version: int, timeout_s: float = 60.0) -> float:
        """Poll until the served version is at least `version`; returns the seconds that took."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if (self.info().get("version") or 0) >= version:
                return time.monotonic() - started
            time.sleep(0.1)
        raise ChildServerError(
            f"server on port {self.port} stuck at {self.info()}, waiting for v{version}; "
            f"{self.log}:\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (a graceful shutdown), SIGKILL after `timeout_s`; returns the exit status."""
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def kill(self) -> int:
        """SIGKILL at once (a crash, or a test's teardown); returns the exit status."""
        self.client.close()
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()
