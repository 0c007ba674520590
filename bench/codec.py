"""Part `codec`: encode/decode throughput and error of every codec on embedding-like rows.

    checknrun bench codec [--rows N] [--dim D] [--threads T] [--codec C ...] [--quick]

Throughput is MB/s of float32 input (rows * dim * 4 bytes) per second, the median of several
timed repeats after one warm-up; decoding writes into a preallocated, already touched array, as
a restore into an existing table does. Errors are measured on seeded rows that look like trained
embeddings (see `embedding_like_rows`). One torch thread by default: throughput per core, which
the int4 target is stated in.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from bench.machine import describe_machine
from publisher.codecs import decode_rows, encode_rows, max_abs_error_bound
from schemas.codec_names import CODEC_BITS, CODECS, row_bytes, scale_bias_bytes

#: rows used for uniform codecs / adaptive codecs, and timed repeats: (full, quick).
ROWS = (262_144, 32_768)
ADAPTIVE_ROWS = (65_536, 8_192)
REPEATS = (7, 3)
#: the target: uniform int4 per core (one torch thread).
INT4_ENCODE_MB_S = 1_000.0
INT4_DECODE_MB_S = 2_000.0


@dataclass(frozen=True)
class CodecResult:
    """One codec's figures on one row set."""

    codec: str
    bits: int
    #: rows the errors are measured on, and rows encoded/decoded in the timed repeats.
    rows: int
    timed_rows: int
    dim: int
    encode_mb_s: float
    decode_mb_s: float
    mse: float
    #: mse divided by the mean square of the rows (0 = lossless).
    rel_mse: float
    #: largest |error| divided by the per-row bound of `max_abs_error_bound` (must be <= 1).
    max_error_to_bound: float
    #: encoded bytes per row (codes plus scale/bias) and the ratio to fp32.
    bytes_per_row: float
    ratio_vs_fp32: float


def embedding_like_rows(n: int, dim: int, seed: int = 0) -> np.ndarray:
    """Seeded float32 rows shaped like trained embedding rows.

    Row scales are log-normal (rows of popular ids drift further from their init), 70% of rows
    are normal, 20% heavy-tailed (Student t, 3 degrees of freedom) and 10% normal with one or
    two outliers of 6 to 12 row standard deviations; a small per-row offset is added.
    """
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(-2.5, 0.7, size=(n, 1)))
    kind = rng.random(n)
    rows = rng.standard_normal((n, dim))
    heavy = kind < 0.2
    rows[heavy] = rng.standard_t(3, size=(int(heavy.sum()), dim))
    outlier_rows = np.flatnonzero(kind > 0.9)
    if outlier_rows.size:
        cols = rng.integers(0, dim, size=(outlier_rows.size, 2))
        mags = rng.uniform(6, 12, size=(outlier_rows.size, 2)) * rng.choice(
            [-1, 1], (outlier_rows.size, 2)
        )
        rows[outlier_rows[:, None], cols] = mags
    rows = rows * scale + rng.normal(0, 0.02, size=(n, 1))
    return rows.astype(np.float32)


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: allocations, caches, lazy torch init
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    codec: str, rows: np.ndarray, repeats: int, timed_rows: int | None = None
) -> CodecResult:
    """Figures of `codec`: errors on all of `rows`, throughput on the first `timed_rows`."""
    n, dim = rows.shape
    timed = rows[: timed_rows or n]
    q = encode_rows(codec, rows)
    decoded = decode_rows(q)
    err = decoded.astype(np.float64) - rows
    power = float(np.mean(np.square(rows, dtype=np.float64)))
    mse = float(np.mean(err * err))
    bound = max_abs_error_bound(q)
    worst = np.abs(err).max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(worst > 0, worst / bound, 0.0)
    enc_bytes = (q.codes.nbytes + scale_bias_bytes(codec, n)) / n

    q_timed = encode_rows(codec, timed)
    out = np.ones_like(timed)
    mb = timed.nbytes / 1e6
    t_enc = _median_seconds(lambda: encode_rows(codec, timed), repeats)
    t_dec = _median_seconds(lambda: decode_rows(q_timed, out), repeats)
    return CodecResult(
        codec=codec,
        bits=CODEC_BITS[codec],
        rows=n,
        timed_rows=timed.shape[0],
        dim=dim,
        encode_mb_s=mb / t_enc,
        decode_mb_s=mb / t_dec,
        mse=mse,
        rel_mse=mse / power if power else 0.0,
        max_error_to_bound=float(ratios.max()),
        bytes_per_row=enc_bytes,
        ratio_vs_fp32=row_bytes("fp32", dim) / enc_bytes,
    )


def format_table(results: Sequence[CodecResult]) -> str:
    """The results as an aligned text table."""
    header = (
        "codec",
        "timed rows",
        "enc MB/s",
        "dec MB/s",
        "rel MSE",
        "err/bound",
        "B/row",
        "x fp32",
    )
    lines = [
        (
            r.codec,
            str(r.timed_rows),
            f"{r.encode_mb_s:,.0f}",
            f"{r.decode_mb_s:,.0f}",
            f"{r.rel_mse:.3e}",
            f"{r.max_error_to_bound:.3f}",
            f"{r.bytes_per_row:.1f}",
            f"{r.ratio_vs_fp32:.2f}",
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )

    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, lines)])


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The row set, the threads and the codecs."""
    parser.add_argument(
        "--rows",
        type=_positive_int,
        help=f"rows (default {ROWS[0]:,}; --quick {ROWS[1]:,}); adaptive codecs are timed on a "
        "quarter",
    )
    parser.add_argument("--dim", type=_positive_int, default=64, help="elements per row")
    parser.add_argument("--threads", type=_positive_int, default=1, help="torch threads")
    parser.add_argument(
        "--codec", dest="codecs", action="append", choices=CODECS, help="only this codec"
    )


def run(
    quick: bool,
    *,
    rows: int | None = None,
    dim: int = 64,
    threads: int = 1,
    codecs: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Benchmark `codecs` (default: all); progress to stderr, the table to stdout; the document.

    Errors are measured on all rows; adaptive codecs, ~20x slower, are timed on a quarter of
    them (`rows` overrides the row count). With int4 among the codecs, the document says whether
    it meets the throughput target.
    """
    codecs = tuple(codecs or CODECS)
    n_full = rows if rows is not None else ROWS[quick]
    n_adaptive = max(1, n_full // 4) if rows is not None else ADAPTIVE_ROWS[quick]
    repeats = REPEATS[quick]
    data = embedding_like_rows(n_full, dim)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    results: list[CodecResult] = []
    try:
        for i, codec in enumerate(codecs, 1):
            timed = n_adaptive if codec.endswith("-adaptive") else n_full
            r = measure(codec, data, repeats, timed)
            results.append(r)
            print(
                f"[{i}/{len(codecs)}] {codec}: encode {r.encode_mb_s:,.0f} MB/s, "
                f"decode {r.decode_mb_s:,.0f} MB/s, rel MSE {r.rel_mse:.3e}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        torch.set_num_threads(previous_threads)
    print(format_table(results))
    doc: dict[str, Any] = {
        "part": "codec",
        "quick": quick,
        "machine": describe_machine(),
        "benchmark": "codec",
        "config": {
            "quick": quick,
            "rows": n_full,
            "adaptive_rows": n_adaptive,
            "dim": dim,
            "threads": threads,
            "repeats": repeats,
            "data": "embedding_like_rows(seed=0)",
        },
        "results": [asdict(r) for r in results],
    }
    int4 = next((r for r in results if r.codec == "int4"), None)
    if int4 is not None:
        doc["int4_target"] = {
            "encode_mb_s": int4.encode_mb_s,
            "decode_mb_s": int4.decode_mb_s,
            "encode_met": int4.encode_mb_s >= INT4_ENCODE_MB_S,
            "decode_met": int4.decode_mb_s >= INT4_DECODE_MB_S,
        }
    return doc
