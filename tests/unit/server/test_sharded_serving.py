"""A server follows a job whose tables are row-range shards exactly as it follows one writer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.sharded_run import job_publishers, publish_step, row_wise
from bench.synthetic_run import SyntheticRun, random_examples, small_config
from publisher.read import ConsistencyScheme
from publisher.read.live_model import LiveModel
from publisher.store import FileStore
from tests.support import dlrm_live, dlrm_scores

CONFIG = small_config(rows=(300, 101), bag_rows=20, dim=8)
TABLE_ROWS = {"embeddings." + f.name: f.rows for f in CONFIG.sparse}


def _scores(live: LiveModel) -> np.ndarray:
    with live.reader() as buffer:
        return dlrm_scores(buffer, random_examples(CONFIG, 64))


@pytest.mark.parametrize("scheme", ["double-buffer", "rwlock"])
@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_a_row_wise_job_serves_like_one_writer(
    tmp_path: Path, codec: str, scheme: ConsistencyScheme
) -> None:
    run = SyntheticRun(FileStore(tmp_path / "single"), "m", CONFIG, codec=codec)
    store = FileStore(tmp_path / "job")
    publishers = job_publishers(store, "m", 2)
    layout = row_wise(TABLE_ROWS, 2)
    servers = [dlrm_live(run.store, "m", scheme), dlrm_live(store, "m", scheme)]
    try:
        for i in range(4):
            publish_step(run, publishers, layout, i)
            for live in servers:
                # The first version bootstraps; the others apply as deltas (stage/commit on the
                # reader-writer scheme, write + replay on the double buffer).
                live.bootstrap() if i == 0 else live.catch_up()
                assert live.version == i + 1
            whole, sharded = (live.digest() for live in servers)
            assert sharded == whole
            assert _scores(servers[1]).tobytes() == _scores(servers[0]).tobytes()
        with servers[1].reader() as buffer:
            held = {table.format for table in buffer.tables.values()}
        assert held == ({"fp32"} if codec == "fp32" else {"int4"})  # quantized serving
    finally:
        for live in servers:
            live.close()
        for publisher in publishers:
            publisher.close()
        run.close()
