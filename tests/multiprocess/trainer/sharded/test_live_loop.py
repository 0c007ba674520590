"""The live loop of a sharded job on 2 gloo ranks, each reading its own (fake) part of a topic
at its own pace: the ranks take the same steps (a rank with nothing trains padding), stop
together at the end or on a stop asked on one rank, and the version's positions are each
rank's reader, their union and the job's summed counters."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from bench.sharded_job import CONFIG, run_ranks, sharded_job
from bench.sharded_job import batch as random_batch
from publisher.read.catalog import Catalog
from publisher.store import FileStore
from tests.multiprocess.trainer.sharded.test_checkpointing_publish import MIXED, MODEL, checkpointer
from trainer.sharded.data import RankBatch, padded_batch
from trainer.sharded.step_votes import StepPlan
from trainer.streams.base import Batch

pytest.importorskip("torchrec")

FEATURES = [f.name for f in CONFIG.sparse]
N_DENSE = len(CONFIG.dense)


class FakeEvents:
    """A rank's part of a topic: `arrivals[i]` events arrive at its i-th poll (0: none); its
    partition is numbered by its rank and its offset is the events taken."""

    def __init__(self, rank: int, arrivals: list[int], stop_at_poll: int | None = None) -> None:
        self.rank = rank
        self.arrivals = list(arrivals)
        self.held = 0
        self.taken = 0
        self.polls = 0
        self.timeouts: list[float] = []
        self.stop_at_poll = stop_at_poll
        self.stop_event = threading.Event()

    def poll(self, timeout_s: float) -> int:
        self.polls += 1
        self.timeouts.append(timeout_s)
        if self.polls == self.stop_at_poll:
            self.stop_event.set()  # as SIGTERM on this rank would
        if not self.held and self.arrivals:
            self.held = self.arrivals.pop(0)
        return self.held

    @property
    def at_end(self) -> bool:
        return not self.held and not self.arrivals

    @property
    def offset(self) -> int:
        return self.taken

    def step_batch(self, plan: StepPlan, rank: int) -> RankBatch:
        batch = self.take(plan.take[rank])
        return padded_batch(batch, plan.local_size, plan.global_size, FEATURES, N_DENSE)

    def take(self, n: int) -> Batch | None:
        assert n == self.held, (n, self.held)  # no sample limit: a step takes all in hand
        self.held = 0
        if not n:
            return None
        dense, sparse, labels = random_batch(1000 * self.rank + self.taken, n)
        self.taken += n
        return Batch(dense=dense, sparse=sparse, labels=labels, offset=self.taken - n)

    def reader(self) -> dict[str, int | str | dict[str, int]]:
        return {"source": "kafka", "topic": "t", "offsets": {str(self.rank): self.taken}}

    def metrics(self) -> dict[str, float]:
        return {"bad_events": float(self.rank + 1), "consumer_lag": float(len(self.arrivals))}


def _live_rank(rank: int, world: int, root: str, arrivals: list[list[int]], stop: int) -> None:
    from trainer.sharded.checkpointing import ShardedCheckpointer
    from trainer.sharded.loop import train_steps
    from trainer.sharded.step_votes import StepAgreement

    job = sharded_job(MIXED)
    ckpt = checkpointer(job, root, world)
    assert isinstance(ckpt, ShardedCheckpointer)
    events = FakeEvents(rank, arrivals[rank], stop_at_poll=stop if rank == 1 else None)
    report = train_steps(
        job.model,  # type: ignore[arg-type]
        job.dense_optimizer,
        events,
        StepAgreement.new(30.0),
        stop_at_end=True,
        stop_event=events.stop_event,
        checkpointer=ckpt,
    )
    done = {
        "steps": report.steps,
        "samples": report.samples,
        "mine": report.end_offset,
        "timeouts": events.timeouts,
    }
    (Path(root) / f"rank{rank}.json").write_text(json.dumps(done))


def _run(tmp_path: Path, arrivals: list[list[int]], stop: int = 0) -> list[dict[str, Any]]:
    run_ranks(_live_rank, 2, str(tmp_path), arrivals, stop, timeout_s=300)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_ranks_at_their_own_pace_take_the_same_steps_and_stop_together_at_the_end(
    tmp_path: Path,
) -> None:
    # poll by poll: step (5, 0), wait, step (8, 2), step (3, 0), then both at their end
    done = _run(tmp_path, [[5, 0, 8, 3], [0, 0, 2]])
    assert [d["steps"] for d in done] == [3, 3]
    assert [d["samples"] for d in done] == [18, 18]
    assert [d["mine"] for d in done] == [16, 2]
    # a rank waits for its reader only after a vote found nothing anywhere: after a step, a
    # rank with nothing (rank 1 at the last step) must not hold up the others
    from trainer.sharded.loop import POLL_S, STEP_POLL_S

    wait, step = POLL_S, STEP_POLL_S
    assert [d["timeouts"] for d in done] == [[wait, step, wait, step, step]] * 2
    latest = Catalog(FileStore(tmp_path), MODEL).latest()
    assert latest is not None
    position = latest.manifest.position
    assert position.samples_seen == 18 and position.step == 3
    assert position.ranks is not None
    assert [r.samples_seen for r in position.ranks] == [16, 2]
    assert [r.reader["offsets"] for r in position.ranks] == [{"0": 16}, {"1": 2}]
    assert position.reader == {"source": "kafka", "topic": "t", "offsets": {"0": 16, "1": 2}}
    metrics = latest.manifest.metrics
    assert {k: metrics[k] for k in ("bad_events", "consumer_lag")} == {
        "bad_events": 3.0,
        "consumer_lag": 0.0,
    }
    # the training metrics of the job's samples (both ranks'), not of padding
    assert metrics["samples"] == metrics["samples_cumulative"] == 18.0
    assert 0.0 < metrics["logloss"] < 5.0


@pytest.mark.slow
def test_a_stop_asked_on_one_rank_stops_both_at_the_same_step_with_a_final_version(
    tmp_path: Path,
) -> None:
    done = _run(tmp_path, [[4] * 50, [1] * 50], stop=4)
    assert [d["steps"] for d in done] == [3, 3]  # the 4th vote says stop
    latest = Catalog(FileStore(tmp_path), MODEL).latest()
    assert latest is not None
    assert latest.manifest.position.samples_seen == 15
    assert latest.manifest.position.reader["offsets"] == {"0": 12, "1": 3}
