"""A 2-rank job trains the same model as 1 rank on the same global batches (every table row,
its row-wise Adagrad state and every dense parameter), table-wise and row-wise."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from tests.unit.trainer.sharded.ranks import FEATURES, saved_model, train_and_save
from trainer.sharded.launch import spawn_ranks

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_two_ranks_train_what_one_trains(tmp_path: Path, sharding: str) -> None:
    models = {}
    for nproc in (1, 2):
        out = tmp_path / f"n{nproc}"
        out.mkdir()
        spawn_ranks(functools.partial(train_and_save, out, sharding), nproc)
        models[nproc] = saved_model(out)
    one, two = models[1], models[2]
    assert sorted(one) == sorted(two)
    assert {f"weight/embeddings.{f.name}" for f in FEATURES} <= set(one)
    assert any(k.startswith("dense/top.") for k in one)
    for key in one:
        np.testing.assert_allclose(two[key], one[key], rtol=1e-5, atol=1e-6, err_msg=key)
    # Training moved the rows and their Adagrad state (the comparison is not of two inits).
    assert one["acc/embeddings.user"].max() > 0
