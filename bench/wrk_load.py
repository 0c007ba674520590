"""Closed-loop HTTP load with `wrk` (the Debian package): N connections posting one body as fast
as the server answers, for a fixed time; its requests/s, latency percentiles and failures.

    load = wrk_load("http://127.0.0.1:8000/v1/predict", body, headers, connections=8, seconds=5)

`wrk` is C and event-driven: on a 2-core machine one of its threads takes a fraction of a core,
where a Python client would take the core the server needs. None where `wrk` is not installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_SCRIPT = """\
wrk.method = "POST"
local f = assert(io.open(os.getenv("WRK_BODY"), "rb"))
wrk.body = f:read("*a")
f:close()
{headers}
"""
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}


@dataclass(frozen=True)
class WrkLoad:
    """What one `wrk` run measured."""

    requests_per_s: float
    p50_ms: float
    p99_ms: float
    requests: int
    #: answers with a status outside 2xx/3xx, and connect/read/write/timeout errors.
    failed: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def have_wrk() -> bool:
    return shutil.which("wrk") is not None


def wrk_load(
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    connections: int = 8,
    seconds: float = 5.0,
    threads: int = 1,
) -> WrkLoad | None:
    """`wrk` posting `body` to `url` over `connections` connections for `seconds` (None
    without wrk); RuntimeError if it fails or prints what this does not read."""
    binary = shutil.which("wrk")
    if binary is None:
        return None
    with tempfile.TemporaryDirectory(prefix="wrk-") as tmp:
        body_path = Path(tmp) / "body"
        body_path.write_bytes(body)
        script = Path(tmp) / "post.lua"
        lines = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items())
        script.write_text(_SCRIPT.format(headers=lines))
        done = subprocess.run(
            [
                binary,
                f"-t{threads}",
                f"-c{connections}",
                f"-d{max(1, round(seconds))}s",
                "--latency",
                "-s",
                str(script),
                url,
            ],
            capture_output=True,
            text=True,
            env={"WRK_BODY": str(body_path), "PATH": "/usr/bin:/bin"},
            timeout=seconds + 60,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    return parse_wrk(done.stdout)


def parse_wrk(out: str) -> WrkLoad:
    """The figures of `wrk --latency`'s report."""
    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    p50 = re.search(r"^\s+50%\s+([\d.]+)(us|ms|s|m)\s*$", out, re.M)
    p99 = re.search(r"^\s+99%\s+([\d.]+)(us|ms|s|m)\s*$", out, re.M)
    if not (rate and total and p50 and p99):
        raise RuntimeError(f"wrk printed a report this does not read:\n{out[-500:]}")
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    failed = int(non_2xx.group(1)) if non_2xx else 0
    if errors:
        failed += sum(int(g) for g in errors.groups())
    return WrkLoad(
        requests_per_s=float(rate.group(1)),
        p50_ms=round(float(p50.group(1)) * _UNITS[p50.group(2)], 3),
        p99_ms=round(float(p99.group(1)) * _UNITS[p99.group(2)], 3),
        requests=int(total.group(1)),
        failed=failed,
    )
