"""The `--workers` phase of `checknrun bench endpoint`: the same store served by `serve --workers
1` and `--workers 2`, one after the other, each loaded by wrk (v2 REST, binary tensors, batch
64, 8 connections):

- idle: requests/s, p50, p99, failed;
- applying: the same load while this process commits a delta of `delta_rows` item rows every
  second (a 100,000-row delta on the full bench): p99 against idle, failed requests;
- memory: the proportional set size (PSS, /proc/PID/smaps_rollup: a shared page counted once
  across the processes that map it) of the server's whole process tree, at rest.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.child_server import ChildServer
from bench.machine import log
from bench.synthetic_run import SyntheticRun
from bench.wrk_load import wrk_load

#: the worker counts compared.
WORKER_COUNTS = (1, 2)


def bench_server(store_url: str, model: str, log_path: Path, **flags: str) -> ChildServer:
    """A `checknrun serve` as every arm of `checknrun bench endpoint` runs it (batches of
    1,024 examples fit, only warnings logged), with `flags` on top."""
    return ChildServer(
        store_url,
        model,
        log_path,
        port=0,
        env=None,
        max_batch="4096",
        max_body_bytes=str(16 * 2**20),
        log_level="warning",
        **flags,
    )


def tree_pss_bytes(pid: int) -> int:
    """PSS of `pid` and every descendant (bytes)."""
    total = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            rollup = Path(f"/proc/{current}/smaps_rollup").read_text()
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in rollup.splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1]) * 1024
        pending.extend(int(c) for c in children)
    return total


class DeltaWriter:
    """Commits a delta of `rows` rows of `table` every `period_s` on a thread, until stopped."""

    def __init__(self, run: SyntheticRun, table: str, rows: int, period_s: float = 1.0) -> None:
        self.run, self.table, self.rows, self.period_s = run, table, rows, period_s
        self.versions: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._write, name="delta-writer", daemon=True)
        self._error: BaseException | None = None

    def __enter__(self) -> DeltaWriter:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise RuntimeError("the delta writer failed") from self._error

    def _write(self) -> None:
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                self.run.touch_rows(self.table, self.rows)
                self.versions.append(self.run.publish("delta").ref.version)
                self._stop.wait(max(0.0, self.period_s - (time.monotonic() - started)))
        except BaseException as exc:  # re-raised by __exit__
            self._error = exc


def measure_workers(
    store_url: str,
    root: Path,
    run: SyntheticRun,
    model: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    seconds: int,
    delta_rows: int,
) -> dict[str, Any]:
    """The phase (see the module docstring) for each of WORKER_COUNTS."""
    out: dict[str, Any] = {"delta_rows": delta_rows, "seconds": seconds}
    for workers in WORKER_COUNTS:
        server = bench_server(
            store_url,
            model,
            root / f"serve-workers-{workers}.log",
            workers=str(workers),
            poll_head_after="0.2",
        )
        try:
            server.wait_ready()
            url = f"{server.url}/v2/models/{model}/infer"
            wrk_load(url, body, headers, seconds=1)  # warm: connections, first allocations
            pss = tree_pss_bytes(server.proc.pid)
            log(f"endpoint: --workers {workers}, idle")
            idle = wrk_load(url, body, headers, seconds=seconds)
            log(f"endpoint: --workers {workers}, a {delta_rows}-row delta every second")
            with DeltaWriter(run, "embeddings.item", delta_rows) as writer:
                busy = wrk_load(url, body, headers, seconds=seconds)
            served = server.client.get("/v1/model").json()["version"]
        finally:
            server.stop()
        assert idle is not None and busy is not None
        out[str(workers)] = {
            "idle": idle.as_dict(),
            "applying": busy.as_dict(),
            "deltas_committed": len(writer.versions),
            "served_after": served,
            "pss_bytes": pss,
            "p99_applying_vs_idle": round(busy.p99_ms / idle.p99_ms, 2),
        }
    one, two = out["1"], out["2"]
    out["throughput_2_vs_1"] = round(
        two["idle"]["requests_per_s"] / one["idle"]["requests_per_s"], 2
    )
    out["pss_2_vs_1"] = round(two["pss_bytes"] / one["pss_bytes"], 2)
    return out
