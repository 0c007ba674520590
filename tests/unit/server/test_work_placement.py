"""Scoring on the loop for a small body, in the threadpool for a large one."""

from __future__ import annotations

import asyncio
import threading

from server.work_placement import INLINE_MAX_BYTES, scored_where_cheapest


def test_a_small_body_is_scored_on_the_loop_and_a_large_one_in_a_thread() -> None:
    async def where(body_bytes: int) -> bool:
        loop_thread = threading.get_ident()
        ran_in = await scored_where_cheapest(body_bytes, threading.get_ident)
        return ran_in == loop_thread

    assert asyncio.run(where(INLINE_MAX_BYTES - 1)) is True
    assert asyncio.run(where(INLINE_MAX_BYTES)) is False
