"""Part `freshness`: train step -> served latency, apply time vs delta size, predict p99.

Runs bench.serving's `freshness`, `apply` and `http` commands as child processes (trainer/
does not import server/). Freshness goes through real
Kafka + MinIO when CHECKNRUN_KAFKA_BOOTSTRAP and CHECKNRUN_S3_ENDPOINT are set (source
~/.cache/checknrun/services/env), else through a file store and a file bus (said in the result).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from typing import Any

from bench.machine import describe_machine, log

#: the target: snapshot -> served p99.
FRESHNESS_P99_S = 2.0


def services() -> tuple[str | None, str | None]:
    """(store URL, bus URL) of the real services with a fresh prefix/topic, or (None, None)."""
    bootstrap = os.environ.get("CHECKNRUN_KAFKA_BOOTSTRAP")
    if not bootstrap or not os.environ.get("CHECKNRUN_S3_ENDPOINT"):
        return None, None
    # A unique prefix and topic per run: old versions and announcements must not leak in.
    tag = uuid.uuid4().hex[:10]
    return f"s3://checknrun-bench/freshness-{tag}", f"kafka://{bootstrap}/checknrun-bench-{tag}"


def _load_bench(argv: list[str]) -> dict[str, Any]:
    """`python -m bench.serving --json ARGV`: its summary goes to stderr as it comes, its JSON
    document (the last line of its stdout) is returned."""
    cmd = [sys.executable, "-m", "bench.serving", "--json", *argv]
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if not line.startswith("{"):
                sys.stderr.write(line)
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} exited with status {proc.returncode}")
    doc: dict[str, Any] = json.loads(lines[-1])
    return doc


def run(quick: bool) -> dict[str, Any]:
    """The three measurements (small and short in quick mode)."""
    store, bus = services()
    fresh_argv = ["--max-seconds", "300" if quick else "900", "freshness"]
    if store and bus:
        fresh_argv += ["--store", store, "--bus", bus]
    if quick:
        fresh_argv += ["--versions", "4", "--interval", "0.3", "--rows", "5000", "--servers", "1"]
    else:
        fresh_argv += ["--versions", "60", "--interval", "1.0", "--servers", "2"]
    log(f"freshness: load_bench {' '.join(fresh_argv)}")
    freshness = _load_bench(fresh_argv)
    apply_argv = ["--max-seconds", "600", "apply"]
    if quick:
        apply_argv += ["--rows", "5000", "--sizes", "500,2000", "--repeats", "1"]
    log(f"freshness: load_bench {' '.join(apply_argv)}")
    apply = _load_bench(apply_argv)
    http_argv = ["--max-seconds", "600", "http"]
    if quick:
        http_argv += ["--rows", "5000", "--duration", "1", "--max-requests", "200"]
    log(f"freshness: load_bench {' '.join(http_argv)}")
    http = _load_bench(http_argv)
    p99_ms = freshness["train_step_to_served"].get("p99_ms")
    p99 = None if p99_ms is None else p99_ms / 1e3
    return {
        "part": "freshness",
        "quick": quick,
        "machine": describe_machine(),
        "real_services": bool(store and bus),
        "commands": {
            "freshness": fresh_argv,
            "apply": apply_argv,
            "http": http_argv,
        },
        "freshness": freshness,
        "apply": apply,
        "http": http,
        "p99_target_s": FRESHNESS_P99_S,
        "p99_met": p99 is not None and p99 <= FRESHNESS_P99_S,
    }
