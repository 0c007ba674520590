"""Part `freshness`: train step -> served latency, apply time vs delta size, predict p99.

    checknrun bench freshness [--load-rate R] [--quick]

Runs the `serving` part's `freshness`, `apply` and `http` commands, each in a child process:
the apply figures include the growth of the measuring process's own memory, which a process
that has just run the other parts (and holds their freed heap) would misstate. Freshness goes
through real Kafka + MinIO when CHECKNRUN_KAFKA_BOOTSTRAP and CHECKNRUN_S3_ENDPOINT are set
(source ~/.cache/checknrun/services/env), else through a file store and a file bus (said in the
result). While freshness is measured, each server takes R predict requests per second of 64
examples over HTTP (bench/predict_load.py; `--load-rate 0` for idle servers), and the result
says where the time went, stage by stage (trainer: encode, upload, commit; bus; server: heard,
plan, queue, fetch + verify, write + swap).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from bench.child_server import REPO
from bench.machine import describe_machine, log

#: the target: snapshot -> served p99.
FRESHNESS_P99_S = 2.0
#: predict requests per second to each server while freshness is measured (default).
LOAD_RATE = 20.0


def services() -> tuple[str | None, str | None]:
    """(store URL, bus URL) of the real services with a fresh prefix/topic, or (None, None)."""
    bootstrap = os.environ.get("CHECKNRUN_KAFKA_BOOTSTRAP")
    if not bootstrap or not os.environ.get("CHECKNRUN_S3_ENDPOINT"):
        return None, None
    # A unique prefix and topic per run: old versions and announcements must not leak in.
    tag = uuid.uuid4().hex[:10]
    return f"s3://checknrun-bench/freshness-{tag}", f"kafka://{bootstrap}/checknrun-bench-{tag}"


def _serving(argv: list[str]) -> dict[str, Any]:
    """The document of `checknrun bench serving ARGV`, run in a child process whose summary
    goes to our stderr as it comes."""
    log(f"freshness: checknrun bench serving {' '.join(argv)}")
    with tempfile.TemporaryDirectory(prefix="checknrun-freshness-") as tmp:
        out = Path(tmp) / "serving.json"
        cmd = [sys.executable, "-m", "bench.cli", "serving", *argv, "--json", str(out)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stderr.write(line)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited with status {proc.returncode}")
        doc: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return doc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--load-rate",
        type=float,
        default=LOAD_RATE,
        help="predict requests per second to each server while freshness is measured "
        "(default %(default)s; 0: idle servers)",
    )


def run(quick: bool, load_rate: float = LOAD_RATE) -> dict[str, Any]:
    """The three measurements (small and short in quick mode)."""
    store, bus = services()
    size = ["--quick"] if quick else []
    fresh_argv = ["--max-seconds", "300" if quick else "900", "freshness", *size]
    fresh_argv += ["--load-rate", str(load_rate)]
    if store and bus:
        fresh_argv += ["--store", store, "--bus", bus]
    if not quick:
        fresh_argv += ["--versions", "60", "--interval", "1.0", "--servers", "2"]
    freshness = _serving(fresh_argv)
    apply_argv = ["--max-seconds", "600", "apply", *size]
    apply = _serving(apply_argv)
    http_argv = ["--max-seconds", "600", "http", *size]
    http = _serving(http_argv)
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
