"""Part `codec`: encode/decode throughput and error of every codec on embedding-like rows.

    checknrun bench codec [--rows N] [--dim D] [--threads T] [--codec C ...] [--quick]

Throughput is MB/s of float32 input (rows * dim * 4 bytes) per second, the median of several
timed repeats after one warm-up; decoding writes into a preallocated, already touched array, as
a restore into an existing table does. Errors are measured on seeded rows that look like trained
embeddings (see `embedding_like_rows`). One torch thread by default: throughput per core, which
the int4 target is stated in.

Next to each uniform 8-, 4- and 2-bit codec, torch's own row-wise kernels (FBGEMM's, in
`torch.ops.quantized`) run on the same rows in the same repeats, taking turns with the codec:
`embedding_bag_{byte,4bit,2bit}_prepack` on all rows in one call (its fastest use), and the
matching `_unpack` decoding the kernel's fused rows chunk by chunk into a preallocated array, as
the codec does (one call on all rows faults in a fresh output array and runs several times
slower). The ratio codec / kernel is the codec's cost over the bare kernel: the codec also
checks its input for NaN (the kernel does not) and splits fused rows into the blob's sections.
Where the codec encodes on the kernel, a third encoder takes turns with them: the encode the
publisher runs, on rows its snapshot has already checked for NaN and inf
(`encode_rows(..., checked_finite=True, max_abs=...)`: the snapshot's check also measures the
largest magnitude, which tells that no fp16 scale or bias can overflow), whose cost over the
kernel is the call's own.
int8 encodes on `embedding_bag_byte_prepack` and stores its float32 scale and bias (blob format
version 3), so its ratios compare the same quantisation. A build without the kernel runs the
kernel's stated rule on torch's elementwise ops, which decodes within the same bound but need not
write the same bytes: some of the kernel's codes differ by one from that rule (near ties, where
the order of its float arithmetic decides); `byte_kernel_codes_off_rule` counts them on the
measured rows.
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
from publisher.cli import positive_int
from publisher.codecs import (
    CHUNK_ELEMENTS,
    codec_of,
    decode_rows,
    encode_rows,
    max_abs_error_bound,
)
from schemas.codec_names import CODECS

#: rows used for uniform codecs / adaptive codecs, and timed repeats: (full, quick).
ROWS = (262_144, 32_768)
ADAPTIVE_ROWS = (65_536, 8_192)
REPEATS = (7, 3)
#: the target: uniform int4 per core (one torch thread).
INT4_ENCODE_MB_S = 1_000.0
INT4_DECODE_MB_S = 2_000.0
#: the target next to torch's kernels: int4 and int8 encode at this fraction of the kernel's.
KERNEL_ENCODE_RATIO = 0.9
#: torch's (prepack, unpack) kernels per bit width of the uniform codecs.
TORCH_KERNELS = {
    8: ("embedding_bag_byte_prepack", "embedding_bag_byte_unpack"),
    4: ("embedding_bag_4bit_prepack", "embedding_bag_4bit_unpack"),
    2: ("embedding_bag_2bit_prepack", "embedding_bag_2bit_unpack"),
}


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
    #: whether the codec encodes / decodes on torch's kernels (publisher/rowwise_kernels.py).
    encode_on_kernel: bool = False
    decode_on_kernel: bool = False
    #: torch's kernel for this bit width on the same rows (see the module docstring); None for
    #: codecs without one, or where this torch lacks it or it refuses the dim.
    kernel_encode_mb_s: float | None = None
    kernel_decode_mb_s: float | None = None
    #: codec throughput / kernel throughput.
    encode_vs_kernel: float | None = None
    decode_vs_kernel: float | None = None
    #: the publisher's encode of rows its snapshot checked (`checked_finite`), where the codec
    #: encodes on the kernel: MB/s and / kernel throughput.
    checked_encode_mb_s: float | None = None
    checked_encode_vs_kernel: float | None = None
    #: int8 only: codes of FBGEMM's byte kernel that differ from its own stated rule,
    #: rint((x - min) * 255 / (max - min + 1e-8)), evaluated by torch's elementwise ops on the
    #: same rows, as a build without the kernel encodes (by one each; module docstring).
    byte_kernel_codes_off_rule: int | None = None


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


def _median_seconds(fns: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Median seconds of each of `fns`, which take turns in every repeat, so that the load of a
    shared machine falls on all of them alike."""
    for fn in fns:
        fn()  # warm-up: allocations, caches, lazy torch init
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, seconds in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def _torch_kernels(codec: str, dim: int) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """torch's (prepack, unpack) for a uniform codec, if this torch has them and takes `dim`."""
    c = codec_of(codec)
    bits = c.bits
    if not c.affine or c.adaptive or bits not in TORCH_KERNELS or dim % (8 // bits):
        return None
    try:
        prepack, unpack = (getattr(torch.ops.quantized, name) for name in TORCH_KERNELS[bits])
    except (AttributeError, RuntimeError):
        return None
    return prepack, unpack


def _kernel_decoder(
    unpack: Callable[..., Any], fused: torch.Tensor, out: np.ndarray
) -> Callable[[], None]:
    """Decode `fused` into `out` chunk by chunk, as the codec does (same chunk rows)."""
    n, dim = out.shape
    chunk = max(1, CHUNK_ELEMENTS // dim)
    out_t = torch.from_numpy(out)

    def decode() -> None:
        for start in range(0, n, chunk):
            out_t[start : start + chunk].copy_(unpack(fused[start : start + chunk])[:, :dim])

    return decode


def byte_kernel_codes_off_rule(prepack: Callable[..., Any], x: torch.Tensor) -> int:
    """How many of `embedding_bag_byte_prepack`'s codes for rows `x` differ from its rule
    computed with torch's elementwise ops (its scale and bias match it exactly)."""
    dim = x.shape[1]
    low, high = x.aminmax(dim=1)
    inverse = 255.0 / ((high - low) + 1e-8)
    own = ((x - low[:, None]) * inverse[:, None]).round().clamp(0, 255).to(torch.uint8)
    return int((prepack(x)[:, :dim] != own).sum())


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
    c = codec_of(codec)
    enc_bytes = (q.codes.nbytes + c.layout.scale_bias_bytes(n)) / n

    q_timed = encode_rows(codec, timed)
    out = np.ones_like(timed)
    mb = timed.nbytes / 1e6
    encoders: list[Callable[[], object]] = [lambda: encode_rows(codec, timed)]
    decoders: list[Callable[[], object]] = [lambda: decode_rows(q_timed, out)]
    bits = c.bits
    on_kernel = c.encodes_on_kernel(dim)
    kernels = _torch_kernels(codec, dim)
    if kernels is not None:
        prepack, unpack = kernels
        timed_t = torch.from_numpy(np.ascontiguousarray(timed))
        fused = prepack(timed_t)
        encoders.append(lambda: prepack(timed_t))
        decoders.append(_kernel_decoder(unpack, fused, np.ones_like(timed)))
        if on_kernel:
            # the bound the publisher's snapshot check measures on the same read
            largest = float(np.abs(timed).max())
            encoders.append(lambda: encode_rows(codec, timed, checked_finite=True, max_abs=largest))
    t_enc = _median_seconds(encoders, repeats)
    t_dec = _median_seconds(decoders, repeats)
    kernel_enc = mb / t_enc[1] if kernels else None
    kernel_dec = mb / t_dec[1] if kernels else None
    checked = len(t_enc) == 3
    return CodecResult(
        codec=codec,
        bits=bits,
        rows=n,
        timed_rows=timed.shape[0],
        dim=dim,
        encode_mb_s=mb / t_enc[0],
        decode_mb_s=mb / t_dec[0],
        mse=mse,
        rel_mse=mse / power if power else 0.0,
        max_error_to_bound=float(ratios.max()),
        bytes_per_row=enc_bytes,
        ratio_vs_fp32=codec_of("fp32").row_bytes(dim) / enc_bytes,
        encode_on_kernel=on_kernel,
        decode_on_kernel=c.decodes_on_kernel(),
        kernel_encode_mb_s=kernel_enc,
        kernel_decode_mb_s=kernel_dec,
        encode_vs_kernel=t_enc[1] / t_enc[0] if kernels else None,
        decode_vs_kernel=t_dec[1] / t_dec[0] if kernels else None,
        checked_encode_mb_s=mb / t_enc[2] if checked else None,
        checked_encode_vs_kernel=t_enc[1] / t_enc[2] if checked else None,
        byte_kernel_codes_off_rule=(
            byte_kernel_codes_off_rule(kernels[0], torch.from_numpy(np.ascontiguousarray(rows)))
            if kernels is not None and bits == 8
            else None
        ),
    )


def format_table(results: Sequence[CodecResult]) -> str:
    """The results as an aligned text table."""
    header = (
        "codec",
        "timed rows",
        "enc MB/s",
        "torch enc",
        "enc/torch",
        "checked/torch",
        "dec MB/s",
        "torch dec",
        "dec/torch",
        "on kernel",
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
            _optional(r.kernel_encode_mb_s, "{:,.0f}"),
            _optional(r.encode_vs_kernel, "{:.2f}x"),
            _optional(r.checked_encode_vs_kernel, "{:.2f}x"),
            f"{r.decode_mb_s:,.0f}",
            _optional(r.kernel_decode_mb_s, "{:,.0f}"),
            _optional(r.decode_vs_kernel, "{:.2f}x"),
            "+".join(
                part
                for part, on in (("enc", r.encode_on_kernel), ("dec", r.decode_on_kernel))
                if on
            )
            or "-",
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


def _optional(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The row set, the threads and the codecs."""
    parser.add_argument(
        "--rows",
        type=positive_int,
        help=f"rows (default {ROWS[0]:,}; --quick {ROWS[1]:,}); adaptive codecs are timed on a "
        "quarter",
    )
    parser.add_argument("--dim", type=positive_int, default=64, help="elements per row")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads")
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
    it meets the throughput target; with int4 or int8, whether their encoding runs at
    KERNEL_ENCODE_RATIO of torch's kernel or better (`kernel_encode_target`).
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
            timed = n_adaptive if codec_of(codec).adaptive else n_full
            r = measure(codec, data, repeats, timed)
            results.append(r)
            vs_kernel = (
                f" ({r.encode_vs_kernel:.2f}x / {r.decode_vs_kernel:.2f}x torch's kernels)"
                if r.encode_vs_kernel is not None and r.decode_vs_kernel is not None
                else ""
            )
            print(
                f"[{i}/{len(codecs)}] {codec}: encode {r.encode_mb_s:,.0f} MB/s, "
                f"decode {r.decode_mb_s:,.0f} MB/s{vs_kernel}, rel MSE {r.rel_mse:.3e}"
                + (
                    f"; byte kernel codes off its rule: {r.byte_kernel_codes_off_rule:,} of "
                    f"{r.rows * r.dim:,}"
                    if r.byte_kernel_codes_off_rule is not None
                    else ""
                ),
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
    kernel_target = {
        r.codec: {
            "encode_vs_kernel": r.encode_vs_kernel,
            "checked_encode_vs_kernel": r.checked_encode_vs_kernel,
            "encode_on_kernel": r.encode_on_kernel,
            "met": r.encode_vs_kernel >= KERNEL_ENCODE_RATIO,
            "met_as_published": (r.checked_encode_vs_kernel or 0.0) >= KERNEL_ENCODE_RATIO,
        }
        for r in results
        if r.codec in ("int4", "int8") and r.encode_vs_kernel is not None
    }
    if kernel_target:
        doc["kernel_encode_target"] = {"ratio": KERNEL_ENCODE_RATIO, **kernel_target}
    return doc
