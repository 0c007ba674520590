"""What the ranks of a job say to each other while they publish: JSON values, rank 0 in the middle.

A `Collective` is the two operations the job's commit (publisher/write/job_publishing.py) needs:
`broadcast` (rank 0's value reaches every rank) and `gather` (rank 0 gets every rank's value in
rank order). Values are JSON only (dict, list, str, int, float, bool, None): what crosses
between ranks is data a rank may check, never a pickle; `gather_bytes` is `gather` of raw
bytes, for arrays (publisher/write/row_transfer.py: the rows rank 0 judges the served loss on).
Each raises `CollectiveError` when a peer does not answer within the collective's timeout,
which is how a dead rank is noticed (docs/FORMAT.md section 2.1).

`ThreadCollective` is the collective of n threads of one process (tests, and a job simulated in
one process); `trainer/sharded/collective.py` implements it over torch.distributed.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeAlias

from schemas.errors import UnavailableError

JSONValue: TypeAlias = dict[str, "JSONValue"] | list["JSONValue"] | str | int | float | bool | None


class CollectiveError(UnavailableError):
    """A rank did not answer a collective in time (dead, stuck, or out of step)."""


class Collective(Protocol):
    """Broadcast and gather of JSON values between the ranks of a job."""

    rank: int
    world_size: int

    def broadcast(self, value: JSONValue) -> JSONValue:
        """Rank 0's `value` on every rank (the others pass None)."""
        ...

    def gather(self, value: JSONValue) -> list[JSONValue] | None:
        """On rank 0, every rank's value in rank order; None on the others."""
        ...

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """On rank 0, every rank's bytes in rank order; None on the others."""
        ...


Operation = Literal["broadcast", "gather", "gather_bytes"]


@dataclass
class _Round:
    """One collective call of every rank: its operation and the JSON text each rank put."""

    operation: Operation
    texts: dict[int, str] = field(default_factory=dict)
    #: a `gather_bytes` round's data, by rank.
    data: dict[int, bytes] = field(default_factory=dict)
    #: ranks that took rank 0's broadcast value so far.
    taken: int = 0


class _Exchange:
    """What the threads of one `ThreadCollective.group` share."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.cond = threading.Condition()
        self.rounds: dict[int, _Round] = {}

    def round(self, number: int, operation: Operation, rank: int) -> _Round:
        """Round `number` (lock held), CollectiveError if another rank made another call."""
        found = self.rounds.setdefault(number, _Round(operation))
        if found.operation != operation:
            raise CollectiveError(
                f"rank {rank} called {operation} as collective call {number}, another rank "
                f"called {found.operation}: the ranks are out of step"
            )
        return found


class ThreadCollective:
    """The collective of one of n threads of a process (`group`): the ranks' n-th calls meet."""

    def __init__(self, exchange: _Exchange, rank: int) -> None:
        self._exchange = exchange
        self.rank = rank
        self.world_size = exchange.world_size
        self._calls = 0

    @classmethod
    def group(cls, n: int, timeout_s: float) -> list[ThreadCollective]:
        """The collectives of ranks 0..n-1, for n threads; each call waits `timeout_s` at most."""
        if n < 1:
            raise ValueError(f"a group needs at least one rank, got {n}")
        exchange = _Exchange(n, timeout_s)
        return [cls(exchange, rank) for rank in range(n)]

    def _next(self) -> int:
        self._calls += 1
        return self._calls

    def broadcast(self, value: JSONValue) -> JSONValue:
        number, ex = self._next(), self._exchange
        with ex.cond:
            current = ex.round(number, "broadcast", self.rank)
            if self.rank == 0:
                current.texts[0] = json.dumps(value)  # what a wire would carry: JSON only
                ex.cond.notify_all()
            elif not ex.cond.wait_for(lambda: 0 in current.texts, ex.timeout_s):
                raise CollectiveError(
                    f"rank {self.rank}: rank 0 did not broadcast within {ex.timeout_s} s"
                )
            if self.rank != 0:
                current.taken += 1
            if current.taken == ex.world_size - 1:
                ex.rounds.pop(number, None)
            result: JSONValue = json.loads(current.texts[0])
            return result

    def gather(self, value: JSONValue) -> list[JSONValue] | None:
        number, ex = self._next(), self._exchange
        with ex.cond:
            current = ex.round(number, "gather", self.rank)
            current.texts[self.rank] = json.dumps(value)
            ex.cond.notify_all()
            if self.rank != 0:
                return None
            if not ex.cond.wait_for(lambda: len(current.texts) == ex.world_size, ex.timeout_s):
                missing = sorted(set(range(ex.world_size)) - set(current.texts))
                raise CollectiveError(
                    f"rank 0: ranks {missing} did not report within {ex.timeout_s} s"
                )
            ex.rounds.pop(number, None)
            return [json.loads(current.texts[r]) for r in range(ex.world_size)]

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        number, ex = self._next(), self._exchange
        with ex.cond:
            current = ex.round(number, "gather_bytes", self.rank)
            current.data[self.rank] = bytes(data)
            ex.cond.notify_all()
            if self.rank != 0:
                return None
            if not ex.cond.wait_for(lambda: len(current.data) == ex.world_size, ex.timeout_s):
                missing = sorted(set(range(ex.world_size)) - set(current.data))
                raise CollectiveError(
                    f"rank 0: ranks {missing} did not send their bytes within {ex.timeout_s} s"
                )
            ex.rounds.pop(number, None)
            return [current.data[r] for r in range(ex.world_size)]


class SoloCollective:
    """The collective of a job of one: one process is a one-part job (its calls return at once,
    its values as they are)."""

    rank = 0
    world_size = 1

    def broadcast(self, value: JSONValue) -> JSONValue:
        return value

    def gather(self, value: JSONValue) -> list[JSONValue] | None:
        return [value]

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        return [data]
