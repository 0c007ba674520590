"""`checknrun train --nproc 2 --data kafka://...` on the real broker: each rank reads its own
partitions, the job trains every good event exactly once and counts the bad ones, and resuming
it on 1 rank, then on 2 again, loses or repeats no event (checked from the committed manifests
and the topic, as tests/integration/test_live_training.py checks the one-process trainer)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from bench.child_server import ChildServer
from publisher.id_map import hashed_rows
from publisher.read.restore import restore
from publisher.store import FileStore
from schemas.id_map_blob import id_key

from .conftest import Services
from .test_live_serving import TOKEN, served_digest
from .test_live_serving import restored_digest as restored_digest_of
from .test_live_training import (
    BAD_EVENTS,
    REPO,
    _env,
    create_topic,
    good_before,
    good_event,
    produce,
    read_topic,
    run,
    train_command,
    versions,
)

#: a sharded job in its default dynamic id space (each id owned by the rank holding its hashed
#: row, docs/FORMAT.md 7.2) with the default count features, its tables split by rows.
SHARDED = ["--sharding", "row_wise"]
#: the same in a hashed id space: no id map, no count feature.
HASHED = ["--id-space", "hash", "--count-features", "", "--sharding", "row_wise"]


def _events(rng: random.Random, first: int, n: int, bad: bool) -> list[tuple[bytes, bytes]]:
    records = [good_event(first + i, rng) for i in range(n)]
    if bad:
        for k, (value, _) in enumerate(BAD_EVENTS):
            records.insert(150 * k + 7, (b"u1", value))
    return records


def _check_versions(store: Path, topic: dict[int, list[bytes]]) -> None:
    """Every version: its samples are the good events before its offsets, and its union
    offsets are its ranks' (each partition read by one rank)."""
    for ref in versions(store, "live"):
        position = ref.manifest.position
        offsets = position.reader["offsets"]
        assert isinstance(offsets, dict)
        assert position.samples_seen == len(good_before(topic, offsets)), (ref.version, position)
        if position.ranks is not None:
            union: dict[str, int] = {}
            for r in position.ranks:
                part = r.reader["offsets"]
                assert isinstance(part, dict) and not set(part) & set(union)
                union.update(part)
            assert union == offsets


def _check_id_maps(store_dir: Path, topic: dict[int, list[bytes]]) -> None:
    """Every version of a dynamic id space: each table's map holds exactly the ids of the good
    events before its offsets, each counted once per event, on a row of its owner's shard
    (docs/FORMAT.md 7.2: the shard its hashed row falls in) when the version was written by
    several ranks."""
    with FileStore(store_dir) as store:
        for ref in versions(store_dir, "live"):
            offsets = ref.manifest.position.reader["offsets"]
            assert isinstance(offsets, dict)
            events = good_before(topic, offsets)
            state = restore(store, "live", ref.version)
            for index, table in enumerate(("embeddings.user", "embeddings.item")):
                entry = ref.manifest.table(table)
                assert entry.has_id_map and len(entry.id_map_refs) == len(entry.parts)
                id_map = state.id_maps[table]
                seen = Counter(id_key(event.ids[index]) for event in events)
                held = {id_map.key_of(r): int(id_map.counts[r]) for r in range(1, id_map.rows)}
                held.pop(None, None)
                assert held == dict(seen), (ref.version, table)
                if entry.shards is None:
                    continue
                starts = [part.row_start for part in entry.parts]
                keys = list(held)
                rows = [id_map.row_of(k) for k in keys]
                owners = np.searchsorted(starts, hashed_rows(keys, entry.rows), side="right")
                homes = np.searchsorted(starts, rows, side="right")
                assert (owners == homes).all(), (ref.version, table)


def _check_served(store_dir: Path, version: int) -> None:
    """A server follows the job's store: it assembles the shards' id maps into the maps and rows
    `restore()` rebuilds, and maps raw ids with them."""
    env = {**os.environ, "CHECKNRUN_SERVER_ADMIN_TOKEN": TOKEN}
    with ChildServer(f"file://{store_dir}", "live", store_dir / "serve.log", env=env) as server:
        server.wait_ready()
        server.wait_version(version)
        with FileStore(store_dir) as store:
            assert served_digest(server)["tensors"] == restored_digest_of(store, version)
        examples = [{"user": "u7", "item": 3}, {"user": "never-seen", "item": 3}]
        body = server.client.post("/v1/predict", json={"examples": examples}).json()
        assert body["version"] == version and body["unknown_ids"]["user"] == 1


@pytest.mark.parametrize("space", ["dynamic", "hash"])
def test_two_ranks_train_every_good_event_of_three_partitions_once(
    services: Services, unique_name: str, tmp_path: Path, space: str
) -> None:
    rng = random.Random(3)
    create_topic(services, unique_name, 3)
    produce(services, unique_name, _events(rng, 0, 2000, bad=True))

    options = SHARDED if space == "dynamic" else HASHED
    command = train_command(services, unique_name, tmp_path, "--stop-at-end", *options)
    dense = ["--dense-features", "price"]  # the events send none: every value missing
    report = run([*command, *dense, "--nproc", "2", "--interval-samples", "500"])
    assert report["nproc"] == 2
    assert report["samples"] == report["samples_seen"] == 2000
    stream = report["stream"]
    for _, reason in BAD_EVENTS:
        assert stream[f"bad_events_{reason}"] == 1, reason
    assert stream["bad_events"] == len(BAD_EVENTS) and stream["consumer_lag"] == 0

    topic = read_topic(services, unique_name)
    refs = versions(tmp_path, "live")
    assert len(refs) >= 4
    last = refs[-1].manifest
    ends = {str(p): len(v) for p, v in topic.items()}
    assert last.position.reader["source"] == "kafka"
    assert last.position.reader["topic"] == unique_name
    assert last.position.reader["offsets"] == ends
    assert last.position.samples_seen == 2000
    assert last.metrics["bad_events"] == len(BAD_EVENTS)
    assert last.position.ranks is not None
    # partitions 0 and 2 (indexes 0 and 2) on rank 0, partition 1 on rank 1
    assert [r.reader["offsets"] for r in last.position.ranks] == [
        {"0": ends["0"], "2": ends["2"]},
        {"1": ends["1"]},
    ]
    _check_versions(tmp_path, topic)
    live = last.model_config_["extra"]["live"]
    assert live["id_space"] == space
    if space == "dynamic":
        assert live["count_features"] == ["user", "item"]
        assert stream["id_admissions"] == 150 + 60 + 12 and stream["id_evictions"] == 0
        assert last.metrics["ids_held_embeddings.user"] == 150
        _check_id_maps(tmp_path, topic)
        _check_served(tmp_path, refs[-1].version)
    else:
        assert live["count_features"] == []
    assert live["dense_features"] == [{"name": "price", "transform": "log1p"}]
    assert last.model_config_["dense"][-2:] == ["price_log1p", "price_missing"]


def test_resume_from_2_ranks_on_1_and_from_1_on_2_loses_or_repeats_no_event(
    services: Services, unique_name: str, tmp_path: Path
) -> None:
    rng = random.Random(4)
    create_topic(services, unique_name, 3)
    produce(services, unique_name, _events(rng, 0, 1500, bad=True))
    command = [*train_command(services, unique_name, tmp_path, *SHARDED), "--resume"]

    first = run([*command[:-1], "--nproc", "2", "--max-samples", "500"])
    assert first["samples"] == first["samples_seen"] == 500  # the last step cut at the limit
    second = run([*command, "--max-samples", "1100"])  # one process
    assert second["samples_seen"] == 1100
    produce(services, unique_name, _events(rng, 1500, 700, bad=False))
    third = run([*command, "--nproc", "2", "--stop-at-end"])
    assert third["samples_seen"] == 2200
    assert third["stream"]["bad_events"] == len(BAD_EVENTS)

    topic = read_topic(services, unique_name)
    last = versions(tmp_path, "live")[-1].manifest
    assert last.position.reader["offsets"] == {str(p): len(v) for p, v in topic.items()}
    assert last.position.samples_seen == 2200
    _check_versions(tmp_path, topic)
    # the maps moved from 2 ranks to 1 and back (re-partitioned: docs/FORMAT.md 7.2) lost or
    # doubled no id and no count
    _check_id_maps(tmp_path, topic)


def test_sigterm_to_the_job_stops_every_rank_at_one_step_with_a_final_version(
    services: Services, unique_name: str, tmp_path: Path
) -> None:
    rng = random.Random(5)
    create_topic(services, unique_name, 3)
    produce(services, unique_name, _events(rng, 0, 3000, bad=True))
    command = train_command(services, unique_name, tmp_path, *SHARDED, "--nproc", "2")
    process = subprocess.Popen(
        [*command, "--interval-samples", "1000"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    deadline = time.monotonic() + 180
    while not versions(tmp_path, "live"):  # the job runs: it trained and committed
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)  # to the spawner: it forwards it to every rank
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-4000:]
    assert "Traceback" not in err
    report = json.loads(out)

    topic = read_topic(services, unique_name)
    last = versions(tmp_path, "live")[-1].manifest
    # the final version holds every step the job took, and each event before its offsets once
    assert last.position.samples_seen == report["samples_seen"] > 0
    _check_versions(tmp_path, topic)
    done = run([*command, "--resume", "--stop-at-end"])
    assert done["samples_seen"] == 3000 and done["stream"]["bad_events"] == len(BAD_EVENTS)
    last = versions(tmp_path, "live")[-1].manifest
    assert last.position.reader["offsets"] == {str(p): len(v) for p, v in topic.items()}
    _check_versions(tmp_path, topic)
