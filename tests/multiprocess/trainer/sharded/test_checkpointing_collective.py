"""TorchCollective: JSON values between the processes of a gloo job, on a group of its own, and
a CollectiveError within the timeout when a peer never answers."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.sharded_job import run_ranks

pytest.importorskip("torchrec")


def _exchange(rank: int, world: int) -> None:
    from trainer.sharded.collective import TorchCollective

    collective = TorchCollective.new(timeout_s=30.0)
    assert (collective.rank, collective.world_size) == (rank, world)
    sent = {"version": 7, "token": "ab" * 8, "rows": [1, 2, 3], "x": 0.5, "ok": True, "n": None}
    got = collective.broadcast(sent if rank == 0 else None)
    assert got == sent
    # Values of different sizes (the gather pads to the longest), unicode included.
    gathered = collective.gather({"rank": rank, "blob": "é" * (100 * rank + 1)})
    if rank == 0:
        assert gathered == [{"rank": r, "blob": "é" * (100 * r + 1)} for r in range(world)]
    else:
        assert gathered is None
    assert collective.broadcast([] if rank == 0 else None) == []


def test_broadcast_and_gather_json_between_processes() -> None:
    run_ranks(_exchange, 2)


def _silent_peer(rank: int, world: int, marker: str) -> None:
    from publisher.write.collective import CollectiveError
    from trainer.sharded.collective import TorchCollective

    collective = TorchCollective.new(timeout_s=2.0)
    done = Path(marker)
    if rank == 0:
        started = time.monotonic()
        with pytest.raises(CollectiveError, match="did not answer"):
            collective.gather({"rank": 0})
        assert time.monotonic() - started < 20.0
        done.write_text("done")
    else:
        # Never takes part in the collective; stays alive until rank 0 has given up.
        while not done.exists():
            time.sleep(0.05)


def test_a_peer_that_never_answers_gives_collective_error_within_the_timeout(
    tmp_path: Path,
) -> None:
    run_ranks(_silent_peer, 2, str(tmp_path / "done"))
