"""A 2-rank job trains the same model as 1 rank on the same global batches (every table row,
its row-wise Adagrad state and every dense parameter), table-wise and row-wise."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.multiprocess.trainer.sharded.ranks import (
    BATCH,
    FEATURES,
    SAMPLES,
    saved_model,
    tiny_stream,
    train_and_save,
)
from trainer.sharded.launch import spawn_ranks
from trainer.streams.base import ColumnarStream

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
    _check_checkpointer_calls(tmp_path / "n2", tiny_stream())


def _check_checkpointer_calls(out: Path, stream: ColumnarStream) -> None:
    """Each rank told its checkpointer the global batch's samples and its own share of them
    (the padding of a short last batch not counted), and the reader position after the batch,
    every step, checkpointed the end (no interval was due: the recorder never checkpoints),
    then closed it."""
    for rank in (0, 1):
        calls = json.loads((out / f"calls{rank}.json").read_text())
        assert calls[-2:] == [["checkpoint_now", SAMPLES], ["close"]]
        steps = [calls[i : i + 2] for i in range(0, len(calls) - 2, 2)]
        assert len(steps) == -(-SAMPLES // BATCH)
        for index, (step, checkpoint) in enumerate(steps):
            lo = index * BATCH
            size = min(BATCH, SAMPLES - lo)
            local = -(-size // 2)
            mine = max(0, min((rank + 1) * local, size) - rank * local)
            assert step == ["step", size, mine]
            assert checkpoint == ["maybe_checkpoint", lo + size]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_a_gpu_rank_trains_what_a_cpu_rank_trains(tmp_path: Path, sharding: str) -> None:
    models = {}
    for device_type in ("cpu", "cuda"):
        out = tmp_path / device_type
        out.mkdir()
        main = functools.partial(train_and_save, out, sharding, device_type=device_type)
        spawn_ranks(main, 1, backend="nccl" if device_type == "cuda" else "gloo")
        models[device_type] = saved_model(out)
    for key, value in models["cpu"].items():
        np.testing.assert_allclose(models["cuda"][key], value, rtol=1e-4, atol=1e-5, err_msg=key)
