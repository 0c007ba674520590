"""Poisoned streams through the real broker: `checknrun replay --poison` breaks a stretch of the
events (labels flipped; a feature's ids scrambled; a numeric input scaled), a live `checknrun
train --gate` trains on them, and from the store's records and evaluations:

- no version trained on a poisoned event is released;
- the poison is caught at once: the first version judged on poisoned events is held;
- release resumes once the stream heals: a version trained after the stretch is released.

MovieLens-1M's first 240,000 ratings (for the numeric input: with the item's like rate so far
as each event's dense field), 20,000 events a version, the gate's default rules.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gate import movielens_with_rate
from publisher.read.catalog import Catalog
from publisher.release import ReleaseLog
from publisher.store import FileStore

from .conftest import Services

REPO = Path(__file__).resolve().parents[2]
EVENTS, INTERVAL = 240_000, 20_000
START, STOP = 100_000, 160_000  # three intervals poisoned
WINDOW = 16_384  # the samples kept to judge a version on (the default --served-loss-samples)


def _run(argv: list[str], timeout: float = 600) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "publisher.cli", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.mark.parametrize("poison", ["labels", "ids", "dense"])
def test_a_poisoned_stretch_is_held_and_release_resumes(
    services: Services, unique_name: str, tmp_path: Path, poison: str
) -> None:
    topic = f"kafka://{services.kafka_bootstrap}/{unique_name}?partitions=1"
    if poison == "dense":
        data = tmp_path / "movielens-rate.csv"
        movielens_with_rate(data, EVENTS)
        source = ["--data", str(data), "--dense-cols", "item_like_rate"]
        spec = f"dense:item_like_rate*100:{START}:{STOP}"  # a rate sent in percent
        features = ["--features", "user,item", "--dense-features", "item_like_rate:raw"]
    else:
        source = ["--data", "movielens"]
        spec = f"labels:{START}:{STOP}" if poison == "labels" else f"ids:item:{START}:{STOP}"
        features = []  # MovieLens' own fields
    _run(["replay", *source, "--to", topic, "--max-events", str(EVENTS), "--poison", spec,
          "--no-progress", "--json"])  # fmt: skip
    store = tmp_path / "store"
    report = json.loads(
        _run(
            [
                "train",
                "--data",
                f"kafka://{services.kafka_bootstrap}/{unique_name}",
                "--store",
                f"file://{store}",
                "--model",
                "live",
                *features,
                "--interval-samples",
                str(INTERVAL),
                "--codec",
                "int4",
                "--gate",
                "--stop-at-end",
                "--no-progress",
                "--json",
            ]
        )
    )
    assert report["samples"] == EVENTS
    fs = FileStore(store)
    refs = Catalog(fs, "live").versions()
    seen = {r.version: r.manifest.position.samples_seen for r in refs}
    trained_on = {
        v: (seen.get(v - 1, 0), s) for v, s in seen.items()
    }  # the events each version's own interval trained on
    log = ReleaseLog(fs, "live")
    released = {r.version for r in log.records() if r.action == "release"}
    evaluations = {v: log.evaluation(v) for v in log.evaluated_versions()}
    said = {v: (e.decision, e.reason) for v, e in evaluations.items() if e is not None}

    # a window is the last WINDOW events of the interval after the version
    def window(v: int) -> tuple[int, int]:
        end = seen.get(v + 1, seen[v])
        return max(seen[v], end - WINDOW), end

    def overlaps(span: tuple[int, int]) -> bool:
        return span[0] < STOP and span[1] > START

    story = "\n".join(
        f"v{v} trained {trained_on[v]} judged {window(v)} {d}: {r}" for v, (d, r) in said.items()
    )
    # A version that trained on poisoned events and could only be judged on poisoned ones is
    # never released (one judged on the healed stream is released only if no worse there).
    unproven = {v for v in said if overlaps(trained_on[v]) and overlaps(window(v))}
    assert unproven and not unproven & released, story
    # caught at once: every version judged on a window of poisoned events is held
    judged_on_poison = [v for v in said if window(v)[0] >= START and window(v)[1] <= STOP]
    assert judged_on_poison, story
    assert all(said[v][0] == "hold" for v in judged_on_poison), story
    # release resumes: a version trained on the healed stream is released
    healed = {v for v, (lo, _) in trained_on.items() if lo >= STOP}
    assert healed & released, story
