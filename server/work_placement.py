"""Where a request's scoring runs: on the event loop for a small batch, in the threadpool for a
large one.

A small batch costs less to score (a forward of ~0.1 ms at batch 64) than handing it to a
thread and back, and under concurrent load the threads only contend for the GIL: measured with
`checknrun bench endpoint` (wrk, 8 connections, batch 64), the threadpool held /v1 to ~450
requests/s and the loop doubled it. A large batch would hold the loop (and /healthz, and every
other connection) for milliseconds, so a body of `INLINE_MAX_BYTES` or more (the size of a
request is what its parsing, checking and forward grow with) goes to the threadpool, where
torch's kernels release the GIL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, ParamSpec, TypeVar

from starlette.concurrency import run_in_threadpool

#: body bytes from which a request is scored in a thread (a batch of ~200 JSON examples).
INLINE_MAX_BYTES: Final = 32 * 1024

P = ParamSpec("P")
T = TypeVar("T")


async def scored_where_cheapest(
    body_bytes: int, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs
) -> T:
    """`work(*args, **kwargs)` on the loop for a body under `INLINE_MAX_BYTES`, else in the
    threadpool."""
    if body_bytes < INLINE_MAX_BYTES:
        return work(*args, **kwargs)
    return await run_in_threadpool(work, *args, **kwargs)
