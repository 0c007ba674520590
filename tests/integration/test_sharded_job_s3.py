"""A job of two ranks (threads) publishes row-wise shards to MinIO and announces on Kafka; a
server follows it and serves what one writer's versions of the same state serve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.sharded_run import job_publishers, publish_step, row_wise
from bench.synthetic_run import SyntheticRun, small_config
from publisher.bus.base import KafkaAddress
from publisher.bus.kafka_bus import KafkaAnnouncementSource, KafkaAnnouncer
from publisher.read import Subscriber, SubscriberOptions
from publisher.read.restore import restore
from publisher.store import FileStore
from publisher.store.s3_store import S3Store
from tests.integration.test_follow_real import s3_settings
from tests.support import dlrm_live, dlrm_sink

CONFIG = small_config(rows=(3000, 1001), bag_rows=20, dim=8)
TABLE_ROWS = {"embeddings." + f.name: f.rows for f in CONFIG.sparse}


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_a_sharded_job_on_minio_is_followed_through_kafka(
    tmp_path: Path, services: Any, unique_name: str, codec: str
) -> None:
    store = S3Store(unique_name, "models", settings=s3_settings(services))
    address = KafkaAddress((services.kafka_bootstrap,), unique_name)
    announcer = KafkaAnnouncer(
        address, "m", delivery_timeout_s=10.0, initial_backoff_s=0.1, max_backoff_s=1.0
    )
    run = SyntheticRun(FileStore(tmp_path / "single"), "m", CONFIG, codec=codec)
    publishers = job_publishers(store, "m", 2, announce=announcer.announce)
    loop = Subscriber(
        store,
        "m",
        dlrm_sink(),
        bus=KafkaAnnouncementSource(address, start="earliest"),
        options=SubscriberOptions(
            poll_timeout_s=0.2, retry_initial_s=0.1, retry_max_s=1.0, poll_head_after_s=30
        ),
    )
    live = loop.live
    reference = dlrm_live(run.store, "m")
    try:
        layout = row_wise(TABLE_ROWS, 2)
        for i in range(3):
            publish_step(run, publishers, layout, i)
            assert announcer.flush(30)
            applied = loop.run(max_versions=1, timeout=30)
            assert applied and applied[-1] == i + 1
        keys = [info.key for info in store.list("m/blobs/")]
        assert any("/r0000/" in k for k in keys) and any("/r0001/" in k for k in keys)
        job, single = restore(store, "m", 3), restore(run.store, "m", 3)
        for name, table in single.tables.items():
            assert job.tables[name].weights.tobytes() == table.weights.tobytes()
        # A rank's rows only: rank 1's shard of f0 and a range across both shards of f1.
        rows = {"embeddings.f0": (1500, 3000), "embeddings.f1": (400, 600)}
        part = restore(store, "m", 3, rows=rows)
        for name, (start, end) in rows.items():
            whole = job.tables[name].weights[start:end]
            assert part.tables[name].weights.tobytes() == whole.tobytes()
        assert part.bytes_read < job.bytes_read
        reference.bootstrap()
        assert live.digest() == reference.digest()
    finally:
        loop.follower.close()
        loop.close()
        reference.close()
        for publisher in publishers:
            publisher.close()
        announcer.close()
        run.close()
        for info in list(store.list("")):
            store.delete(info.key)
        store.close()
