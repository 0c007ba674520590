"""The publisher's `Collective` (publisher/write/job_publishing.py) over torch.distributed.

The publishing thread of every rank talks to its peers while the training thread runs its own
collectives (the embedding all-to-alls, the dense all-reduce). Two threads issuing collectives
on one process group can interleave and deadlock, so `TorchCollective` owns a gloo group of its
own (`dist.new_group`, which every rank must call in the same order). Values travel as JSON in
uint8 tensors, never pickled (also `JsonGather`'s, the all-gather of every rank's value):

    broadcast: rank 0 ──int64 size──> all;  rank 0 ──uint8 payload (size)──> all
    gather:    all <──int64 sizes──> all (all_gather);  all ──uint8 payload, padded to the
               largest size──> rank 0, which cuts each rank's at its own size

A peer that does not answer within the group's timeout makes the call raise `CollectiveError`
(gloo gives up on the pending operation; the group is unusable afterwards, as the job is).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Self, cast

import torch
import torch.distributed as dist

from publisher.write.collective import CollectiveError, JSONValue


class GlooGroup:
    """A gloo group of every rank of the job that one kind of caller uses alone (so its calls
    cannot interleave with anyone else's), and the one way its calls fail."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float) -> None:
        """`group`: a gloo group of the job's ranks used by nothing else; `timeout_s`: what it
        was created with (named in errors)."""
        self.group = group
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    @classmethod
    def new(cls, timeout_s: float) -> Self:
        """One on a new gloo group of every rank (a collective call itself: every rank makes
        it, in the same order as its other `new_group` calls)."""
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        assert group is not None  # every rank is a member
        return cls(group, timeout_s)

    def run(self, what: str, call: Callable[[], object]) -> None:
        """`call()`, a collective on the group: CollectiveError when a peer does not answer."""
        try:
            call()
        except RuntimeError as exc:  # gloo's timeout and lost-peer errors (DistBackendError)
            raise CollectiveError(
                f"rank {self.rank}/{self.world_size}: {what} failed, a peer did not answer "
                f"within {self.timeout_s:g} s: {exc}"
            ) from exc


class TorchCollective(GlooGroup):
    """Rank 0's value to every rank (`broadcast`), every rank's value to rank 0 (`gather`)."""

    def broadcast(self, value: JSONValue) -> JSONValue:
        """Rank 0's `value` on every rank (the others pass None)."""
        payload = _encode(value) if self.rank == 0 else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        self.run("broadcast", lambda: dist.broadcast(size, 0, group=self.group))
        if self.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.run("broadcast", lambda: dist.broadcast(payload, 0, group=self.group))
        return _decode(payload)

    def gather(self, value: JSONValue) -> list[JSONValue] | None:
        """Every rank's `value` in rank order on rank 0; None on the others."""
        parts = self._gather_payload(_encode(value))
        return None if parts is None else [_decode(p) for p in parts]

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Every rank's bytes in rank order on rank 0; None on the others."""
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else _EMPTY
        parts = self._gather_payload(payload)
        return None if parts is None else [p.numpy().tobytes() for p in parts]

    def _gather_payload(self, payload: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's uint8 `payload` (any length) on rank 0, trimmed; None elsewhere."""
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        mine = torch.tensor([payload.numel()], dtype=torch.int64)
        self.run("gather", lambda: dist.all_gather(sizes, mine, group=self.group))
        longest = max(int(s.item()) for s in sizes)
        if longest == 0:  # every rank knows: nothing to send
            return [_EMPTY] * self.world_size if self.rank == 0 else None
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: payload.numel()] = payload
        parts = (
            [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
            if self.rank == 0
            else None
        )
        self.run("gather", lambda: dist.gather(padded, parts, dst=0, group=self.group))
        if parts is None:
            return None
        return [p[: int(s.item())] for p, s in zip(parts, sizes, strict=True)]


#: the payload room of `JsonGather`'s first all-gather (bytes); grown to the largest seen.
FIRST_ROOM = 1 << 16


class JsonGather:
    """Every rank's JSON value on every rank, usually in one all-gather: each rank sends its
    size and payload in a buffer of an agreed room (`FIRST_ROOM`, then the largest payload any
    rank sent); a payload larger than the room is sent again, in a second all-gather of the
    largest size, which becomes the room. Every rank decides the same from the sizes."""

    def __init__(self, group: GlooGroup, room: int = FIRST_ROOM) -> None:
        self.group = group
        self.room = room

    def __call__(self, value: JSONValue) -> list[JSONValue]:
        group = self.group
        payload = _encode(value)
        size = payload.numel()
        buffer = torch.zeros(8 + self.room, dtype=torch.uint8)
        buffer[:8] = torch.tensor([size], dtype=torch.int64).view(torch.uint8)
        if size <= self.room:
            buffer[8 : 8 + size] = payload
        parts = [torch.empty_like(buffer) for _ in range(group.world_size)]
        group.run("an all-gather", lambda: dist.all_gather(parts, buffer, group=group.group))
        sizes = [int(p[:8].view(torch.int64).item()) for p in parts]
        longest = max(sizes)
        if longest > self.room:  # every rank sees it: all send again, in the larger room
            self.room = longest
            padded = torch.zeros(longest, dtype=torch.uint8)
            padded[:size] = payload
            again = [torch.empty_like(padded) for _ in range(group.world_size)]
            group.run("an all-gather", lambda: dist.all_gather(again, padded, group=group.group))
            return [_decode(a[:n]) for a, n in zip(again, sizes, strict=True)]
        return [_decode(p[8 : 8 + n]) for p, n in zip(parts, sizes, strict=True)]


_EMPTY = torch.empty(0, dtype=torch.uint8)


def _encode(value: JSONValue) -> torch.Tensor:
    data = json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _decode(payload: torch.Tensor) -> JSONValue:
    return cast(JSONValue, json.loads(payload.numpy().tobytes()))
