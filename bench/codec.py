"""Part `codec`: encode/decode throughput per codec and its error (bench.codec_measure)."""

from __future__ import annotations

from typing import Any

from bench import codec_measure
from bench.machine import describe_machine

#: the target: uniform int4 per core (one torch thread).
INT4_ENCODE_MB_S = 1_000.0
INT4_DECODE_MB_S = 2_000.0


def run(quick: bool) -> dict[str, Any]:
    """The codec benchmark on one thread (throughput per core), plus the int4 target check."""
    report = codec_measure.run(quick, None, threads=1)
    int4 = next(r for r in report["results"] if r["codec"] == "int4")
    return {
        "part": "codec",
        "quick": quick,
        "machine": describe_machine(),
        **report,
        "int4_target": {
            "encode_mb_s": int4["encode_mb_s"],
            "decode_mb_s": int4["decode_mb_s"],
            "encode_met": int4["encode_mb_s"] >= INT4_ENCODE_MB_S,
            "decode_met": int4["decode_mb_s"] >= INT4_DECODE_MB_S,
        },
    }
