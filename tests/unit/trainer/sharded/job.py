"""What the sharded tests compare: a rank's state as numpy copies, keyed by shard."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from bench.sharded_job import Job


def sharded_state(job: Job) -> dict[str, np.ndarray]:
    """This rank's rows and accumulators (`<table>/<row_start>/w|acc`), dense parameters and
    dense optimizer tensors, as numpy copies."""
    from trainer.sharded.local_shards import local_shards

    out: dict[str, np.ndarray] = {}
    for name, table in local_shards(job.model).items():
        for s in table.shards:
            out[f"{name}/{s.row_start}/w"] = s.weight.detach().clone().numpy()
            out[f"{name}/{s.row_start}/acc"] = s.accumulator.detach().clone().numpy()
    for key, value in job.model.state_dict().items():
        if not hasattr(value, "local_shards"):
            out[f"dense/{key}"] = value.detach().clone().numpy()
    for i, per in job.dense_optimizer.state_dict()["state"].items():
        for k, v in per.items():
            out[f"opt/{i}/{k}"] = v.detach().clone().numpy()
    return out


def expected_rows(
    tables: Mapping[str, np.ndarray], accumulators: Mapping[str, np.ndarray], job: Job
) -> dict[str, np.ndarray]:
    """The slices of global `tables` and `accumulators` this rank's shards should hold, keyed
    like `sharded_state`."""
    from trainer.sharded.local_shards import local_shards

    out: dict[str, np.ndarray] = {}
    for name, table in local_shards(job.model).items():
        for s in table.shards:
            out[f"{name}/{s.row_start}/w"] = tables[name][s.row_start : s.row_end]
            out[f"{name}/{s.row_start}/acc"] = accumulators[name][s.row_start : s.row_end]
    return out


def assert_holds_expected(job: Job, root: str) -> None:
    """The rank's shards, dense state and dense optimizer equal, bitwise, what `root`'s
    expected.npz holds (global tables `table/NAME`, accumulators `acc/NAME`, `dense/`, `opt/`)."""
    with np.load(Path(root) / "expected.npz") as data:
        expected = dict(data)
    tables = {k.removeprefix("table/"): v for k, v in expected.items() if k.startswith("table/")}
    accs = {k.removeprefix("acc/"): v for k, v in expected.items() if k.startswith("acc/")}
    want = expected_rows(tables, accs, job)
    want.update({k: v for k, v in expected.items() if k.startswith(("dense/", "opt/"))})
    got = sharded_state(job)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert np.array_equal(got[key].reshape(value.shape), value), key
