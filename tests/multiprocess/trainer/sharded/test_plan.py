"""The sharding plan: row-wise never leaves a rank an empty shard (FBGEMM's fused CPU backward
reads past its hash-size array on one), the tables too small for it go table-wise."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from torchrec.distributed.sharding_plan import _calculate_rw_shard_sizes_and_offsets

from tests.multiprocess.trainer.sharded.ranks import tiny_stream
from trainer.online import DLRMSettings, dlrm_config
from trainer.sharded.launch import spawn_ranks
from trainer.sharded.local_shards import local_shards
from trainer.sharded.model import build_sharded_dlrm
from trainer.sharded.plan import never_empty, row_wise_leaves_a_rank_empty


def test_an_empty_row_wise_shard_is_predicted_as_torchrec_splits() -> None:
    for world in range(1, 9):
        for rows in range(1, 50):
            sizes, _ = _calculate_rw_shard_sizes_and_offsets(rows, world, 4)
            assert row_wise_leaves_a_rank_empty(rows, world) == any(s[0] == 0 for s in sizes), (
                rows,
                world,
            )


def test_only_row_wise_tables_that_would_leave_a_rank_empty_go_table_wise() -> None:
    per_table = {"big": "row_wise", "five": "row_wise", "one": "row_wise", "tw": "table_wise"}
    rows = {"big": 1000, "five": 5, "one": 1, "tw": 1}
    assert never_empty(per_table, rows, 1) == per_table
    assert never_empty(per_table, rows, 2) == per_table | {"one": "table_wise"}
    assert never_empty(per_table, rows, 4) == per_table | {
        "five": "table_wise",
        "one": "table_wise",
    }


def _shard_rows(out: Path, rank: int, world_size: int, local_rank: int) -> None:
    stream = tiny_stream()
    config = dlrm_config(stream.features, stream.dense_names, DLRMSettings(embedding_dim=4))
    model = build_sharded_dlrm(
        config, sharding="row_wise", device=torch.device("cpu"), seed=1, sparse_lr=0.1
    )
    held = {name: [s.rows for s in t.shards] for name, t in local_shards(model).items()}
    kinds = {name: p.sharding_type for name, p in model.plan.plan["embeddings"].items()}
    (out / f"rows{rank}.json").write_text(json.dumps({"held": held, "kinds": kinds}))


@pytest.mark.slow
def test_a_row_wise_job_holds_no_empty_shard(tmp_path: Path) -> None:
    spawn_ranks(functools.partial(_shard_rows, tmp_path), 2)
    docs = [json.loads((tmp_path / f"rows{r}.json").read_text()) for r in (0, 1)]
    assert (
        docs[0]["kinds"]
        == docs[1]["kinds"]
        == {
            "user": "row_wise",
            "item": "row_wise",
            "genre": "row_wise",
            "one": "table_wise",
        }
    )
    held = [d["held"] for d in docs]
    assert all(0 not in rows for h in held for rows in h.values())
    # the 1-row table lives whole on one rank; the others are split over both
    assert sorted(len(h["embeddings.one"]) for h in held) == [0, 1]
    assert all(len(h["embeddings.user"]) == 1 for h in held)
