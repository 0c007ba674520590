"""Open-loop predict load on servers over HTTP, from a process of its own.

    python -m bench.predict_load BODY_FILE RATE URL [URL ...] > result.json
    (the load runs until stdin closes; the result is one JSON document on stdout)

Each server gets RATE requests per second on a fixed schedule (`PredictLoad`): a request's
latency counts from the moment it was due, not from when a client got to send it, so a server
that stalls is charged for the requests that queued behind the stall (no coordinated omission),
and a slow server does not lower the load it is offered. It runs in its own process so that its
clients do not take the GIL from the measuring process (the trainer and the watchers of the
freshness bench).
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.child_server import REPO


def percentiles(values: list[float]) -> dict[str, float]:
    """p50/p99/max/mean in milliseconds of values in seconds."""
    if not values:
        return {"n": 0}
    a = np.asarray(values) * 1000.0
    return {
        "n": len(values),
        "p50_ms": round(float(np.percentile(a, 50)), 3),
        "p99_ms": round(float(np.percentile(a, 99)), 3),
        "max_ms": round(float(a.max()), 3),
        "mean_ms": round(float(a.mean()), 3),
    }


#: clients per server: enough that requests keep their schedule while a few are slow.
CLIENTS_PER_SERVER = 8


@dataclass
class RequestSamples:
    """Sequential requests' answers: seconds of each answered 200, and the others counted."""

    latencies: list[float] = field(default_factory=list)
    failed: int = 0
    first_error: str | None = None


JSON_HEADERS = {"Content-Type": "application/json"}


def post_sequentially(
    client: httpx.Client,
    path: str,
    bodies: Sequence[bytes],
    n: int,
    into: RequestSamples,
    on_answer: Callable[[httpx.Response], None] | None = None,
) -> None:
    """`n` sequential POSTs of JSON `bodies` (in turn) to `path` on `client`'s keep-alive
    connection, timed into `into`; `on_answer` sees each 200."""
    for i in range(n):
        started = time.perf_counter()
        try:
            response = client.post(path, content=bodies[i % len(bodies)], headers=JSON_HEADERS)
            ok, error = response.status_code == 200, f"{response.status_code} {response.text}"
        except httpx.HTTPError as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"
        elapsed = time.perf_counter() - started
        if ok:
            into.latencies.append(elapsed)
            if on_answer is not None:
                on_answer(response)
        else:
            into.failed += 1
            into.first_error = into.first_error or error[:500]


class PredictLoad:
    """`rate` POST /v1/predict per second of `body` to each of `urls`, until `stop`."""

    def __init__(self, urls: list[str], body: bytes, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {rate}")
        self.urls, self.body, self.rate = urls, body, rate
        self._stop = threading.Event()
        self._due: list[queue.Queue[float | None]] = [queue.Queue() for _ in urls]
        self._lock = threading.Lock()
        self.latencies: list[float] = []
        self.statuses: dict[str, int] = {}
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for i, url in enumerate(self.urls):
            for _ in range(CLIENTS_PER_SERVER):
                self._threads.append(threading.Thread(target=self._client, args=(url, i)))
        self._threads.append(threading.Thread(target=self._schedule))
        for t in self._threads:
            t.start()

    def stop(self) -> dict[str, Any]:
        """Stop sending, wait for the requests in flight; the figures."""
        self._stop.set()
        for t in self._threads:
            t.join()
        return self.result()

    def result(self) -> dict[str, Any]:
        figures: dict[str, Any] = {"rate_per_server": self.rate, "servers": len(self.urls)}
        figures["requests"] = sum(self.statuses.values())
        figures["statuses"] = dict(self.statuses)
        if self.latencies:
            figures.update(percentiles(self.latencies))
        return figures

    def _schedule(self) -> None:
        period = 1.0 / self.rate
        due = time.monotonic()
        while not self._stop.is_set():
            for q in self._due:
                q.put(due)
            due += period
            delay = due - time.monotonic()
            if delay > 0:
                self._stop.wait(delay)
        for q in self._due:
            for _ in range(CLIENTS_PER_SERVER):
                q.put(None)

    def _client(self, url: str, i: int) -> None:
        headers = {"Content-Type": "application/json"}
        with httpx.Client(base_url=url, timeout=30) as c:
            while (due := self._due[i].get()) is not None:
                try:
                    r = c.post("/v1/predict", content=self.body, headers=headers)
                    status = str(r.status_code)
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                elapsed = time.monotonic() - due
                with self._lock:
                    self.statuses[status] = self.statuses.get(status, 0) + 1
                    if status == "200":
                        self.latencies.append(elapsed)


class LoadProcess:
    """`python -m bench.predict_load` as a child: started by `start`, stopped by `stop`."""

    def __init__(self, urls: list[str], body_file: Path, rate: float) -> None:
        self.cmd = [sys.executable, "-m", "bench.predict_load", str(body_file), str(rate), *urls]
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def stop(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Close its stdin (it stops sending) and read its figures."""
        assert self.proc is not None
        out, _ = self.proc.communicate(timeout=timeout_s)  # closes stdin, reads stdout
        if self.proc.returncode != 0:
            raise RuntimeError(f"{' '.join(self.cmd)} exited with status {self.proc.returncode}")
        figures: dict[str, Any] = json.loads(out)
        return figures

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def main(argv: list[str]) -> int:
    body_file, rate, *urls = argv
    load = PredictLoad(urls, Path(body_file).read_bytes(), float(rate))
    load.start()
    sys.stdin.read()  # until the parent closes our stdin
    json.dump(load.stop(), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
