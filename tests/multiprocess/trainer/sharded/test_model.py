"""The sharded DLRM: initial rows independent of the shards, local shards as views, and a
dense part and tables that make the servers' DLRM."""

from __future__ import annotations

import pytest
import torch

from tests.multiprocess.trainer.sharded.ranks import check_local_shards
from trainer.sharded import model
from trainer.sharded.launch import spawn_ranks


def test_initial_rows_do_not_depend_on_shard_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model, "INIT_BLOCK_ROWS", 8)
    whole = model.initial_rows(seed=3, table=1, dim=4, rows=21, start=0, end=21)
    assert whole.shape == (21, 4)
    assert whole.abs().max() <= 0.5  # uniform in +-1/sqrt(dim)
    for cut in (1, 7, 8, 13, 20):
        parts = [model.initial_rows(3, 1, 4, 21, 0, cut), model.initial_rows(3, 1, 4, 21, cut, 21)]
        assert torch.equal(torch.cat(parts), whole)
    assert not torch.equal(model.initial_rows(3, 2, 4, 21, 0, 21), whole)
    assert not torch.equal(model.initial_rows(4, 1, 4, 21, 0, 21), whole)


@pytest.mark.slow
def test_local_shards_are_views_and_the_dense_part_is_dlrms() -> None:
    spawn_ranks(check_local_shards, 1)
