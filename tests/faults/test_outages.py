"""The broker or the object store stops for a while during a real training run.

Kafka down: training and checkpointing go on (HEAD keeps moving; announcements are skipped), and
a server that polls HEAD after `--poll-head-after` seconds without announcements keeps following
through the store, then takes announcements again once the broker is back.

MinIO down: the trainer keeps training; the background publisher folds the snapshots that wait
into one pending snapshot (the trainer's JSON report counts the merges), so memory
stays bounded; publishing resumes when MinIO is back, and the state restored from the store
afterwards equals, bit for bit, the state of the same run with no outage (fp32 codec).
"""

from __future__ import annotations

import time

import numpy as np

from publisher.read.catalog import Catalog
from publisher.read.restore import restore
from publisher.store import open_store
from tests.support import wait_for

from .conftest import (
    PrivateServices,
    Processes,
    examples_for,
    kafka_url,
    metric_value,
    s3_url,
    train_args,
)


def _head(store_url: str, model: str) -> int:
    with open_store(store_url) as store:
        head = Catalog(store, model).head()
    return 0 if head is None else head.version


def _wait_head(store_url: str, model: str, version: int, timeout: float = 90) -> None:
    """Wait until HEAD is at least `version`."""
    wait_for(
        lambda: _head(store_url, model) >= version,
        timeout,
        lambda: f"HEAD to reach {version} (at {_head(store_url, model)})",
        poll_s=0.2,
    )


def test_kafka_down_during_training(
    private_services: PrivateServices, procs: Processes, unique_name: str, s3_env: None
) -> None:
    model, store_url = "kdown", s3_url(unique_name)
    bus = kafka_url(private_services, unique_name)
    # Far more samples than the outage needs (~15 s of training per 200k): the trainer runs
    # until this test stops it with SIGTERM, however slowly the broker stops and restarts.
    trainer = procs.spawn(
        train_args(
            store_url,
            model,
            bus=bus,
            codec="int8",
            max_samples=5_000_000,
            extra=["--interval-seconds", "1", "--threads", "1"],
        ),
        "trainer",
    )
    _wait_head(store_url, model, 1)
    server = procs.server(store_url, model, "server", bus=bus, poll_head_after="2")
    server.wait_ready()
    examples = examples_for(server.info()["features"], 8)
    before = server.info()["version"]

    down_at = time.monotonic()
    private_services.down("kafka")
    stopped_s = time.monotonic() - down_at
    head_at_down = _head(store_url, model)
    # Served versions keep advancing through HEAD polls while the broker is gone.
    caught_up_s = server.wait_version(head_at_down + 2, timeout_s=60)
    assert server.client.post("/v1/predict", json={"examples": examples}).status_code == 200
    assert trainer.poll() is None, "the trainer must keep training without the broker"
    up_s = private_services.up("kafka")
    head_at_up = _head(store_url, model)
    # Publishing goes on with the broker back; then stop the trainer as in production.
    _wait_head(store_url, model, max(head_at_down + 4, head_at_up + 1), timeout=120)
    assert trainer.poll() is None, "the trainer must keep training"
    trainer.terminate()  # SIGTERM: checkpoint and exit
    trainer_done = procs.finish(trainer, "trainer", timeout=300)
    assert trainer_done.returncode == 0, trainer_done.stderr[-3000:]
    assert trainer_done.report()["stopped"], "the trainer ended before SIGTERM"
    final = _head(store_url, model)
    assert final > head_at_down + 2
    server.wait_version(final, timeout_s=60)
    text = server.metrics()
    assert metric_value(text, "follower_events_total", 'reason="head_polls"') >= 1
    assert server.info()["rejected_versions"] == 0
    print(
        f"RELIABILITY kafka down: stop took {stopped_s:.1f} s; server v{before} -> followed "
        f"HEAD v{head_at_down}+2 through polls in {caught_up_s:.1f} s after the stop; "
        f"broker back in {up_s:.1f} s; final v{final} served; trainer exit 0"
    )


def _tables(store_url: str, model: str) -> tuple[int, dict[str, np.ndarray]]:
    with open_store(store_url) as store:
        state = restore(store, model)
    arrays = {f"table:{k}": t.weights for k, t in state.tables.items()}
    arrays |= {f"aux:{k}": t.aux for k, t in state.tables.items()}
    arrays |= {f"dense:{k}": v for k, v in state.dense.items()}
    arrays |= {f"opt:{k}": v for k, v in state.optimizer.items()}
    return state.position.samples_seen, arrays


def test_minio_down_during_training(
    private_services: PrivateServices, procs: Processes, unique_name: str, s3_env: None
) -> None:
    model, store_url = "sdown", s3_url(unique_name)
    max_samples = 160 * 1024
    args = train_args(store_url, model, max_samples=max_samples, interval_samples=2048)
    trainer = procs.spawn(args, "trainer")
    _wait_head(store_url, model, 2)
    private_services.down("minio")
    down_at = time.monotonic()
    time.sleep(8)
    assert trainer.poll() is None, "the trainer must keep training without the store"
    up_s = private_services.up("minio")
    back_at = time.monotonic()
    head_before = _head(store_url, model)
    deadline = time.monotonic() + 120
    while _head(store_url, model) == head_before and trainer.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    resumed_s = time.monotonic() - back_at
    done = procs.finish(trainer, "trainer", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = done.report()
    # Snapshots taken during the outage merged into the one pending: bounded memory.
    assert report["summary"]["merged"] >= 1, report["summary"]
    assert report["summary"]["versions"] < report["summary"]["checkpoints"]
    samples, outage_state = _tables(store_url, model)
    assert samples == max_samples

    # The same run with no outage, into another prefix: the restored states must be identical.
    control_url = f"s3://{unique_name}/control"
    control = procs.run(train_args(control_url, model, max_samples=max_samples), "control")
    assert control.returncode == 0, control.stderr[-3000:]
    _, control_state = _tables(control_url, model)
    assert outage_state.keys() == control_state.keys()
    for name, array in control_state.items():
        np.testing.assert_array_equal(outage_state[name], array, err_msg=name)
    print(
        f"RELIABILITY minio down {back_at - down_at - up_s:.1f} s (+{up_s:.1f} s restart): "
        f"{report['summary']['checkpoints']} checkpoints, {report['summary']['merged']} merged, "
        f"{report['summary']['versions']} versions; first version after restart in "
        f"{resumed_s:.1f} s; restored state bit-identical to a run without outage"
    )
