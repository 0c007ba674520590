"""trainer/row_buffers.py: views lent to one snapshot at a time, recycled on release."""

from __future__ import annotations

import gc

import numpy as np

from trainer.row_buffers import RowBufferPool


def test_a_released_buffer_is_lent_again_and_a_lent_one_is_not() -> None:
    pool = RowBufferPool()
    first = pool.take("t.weight", 100, 8)
    second = pool.take("t.weight", 100, 8)
    assert not np.shares_memory(first, second)
    allocated = pool.allocated_bytes
    address = first.__array_interface__["data"][0]
    del first
    gc.collect()
    again = pool.take("t.weight", 90, 8)
    assert again.__array_interface__["data"][0] == address
    assert pool.allocated_bytes == allocated


def test_an_empty_take_leaves_the_free_buffers_alone() -> None:
    # A table with no dirty rows must not tie up its big buffer for the snapshot's lifetime.
    pool = RowBufferPool()
    big = pool.take("t.weight", 1000, 8)
    del big
    gc.collect()
    empty = pool.take("t.weight", 0, 8)
    assert empty.shape == (0, 8) and empty.dtype == np.float32
    allocated = pool.allocated_bytes
    pool.take("t.weight", 1000, 8)
    assert pool.allocated_bytes == allocated  # the free buffer was still there
