"""The benchmark trainer's restore stands for a real checkpoint of the codec (bench/workloads)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.workloads import BenchTrainer, make_workload
from schemas.delta_blob import round_to_bfloat16


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_load_state_stores_the_row_state_as_a_checkpoint_of_the_codec_does(codec: str) -> None:
    workload = make_workload("synthetic", quick=True, table_cap=50, intervals=1)
    trainer = BenchTrainer(workload)
    for batch in trainer.batches(0, 2048):
        trainer.train(batch)
    saved = trainer.save_state()
    sparse = trainer.optimizers[0]
    params = [p for g in sparse.param_groups for p in g["params"]]
    exact = [sparse.state[p]["sum"].numpy().copy() for p in params]
    trainer.load_state(saved, codec)
    got = [sparse.state[p]["sum"].numpy() for p in params]
    expected = exact if codec == "fp32" else [round_to_bfloat16(a) for a in exact]
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(g, e, strict=True)
    if codec != "fp32":
        assert any(not np.array_equal(g, e) for g, e in zip(got, exact, strict=True))
