"""What the apply side sends a worker over its control pipe, and what comes back.

Sent with torch's multiprocessing pickler: a copy's tensors, moved to shared memory first, go
as file descriptors (the worker maps the same memory), everything else (the module's
structure, id maps, the served version) by value. Between processes of one server only: never
bytes from the store or a client.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from publisher.id_map import IdMapWrite
from publisher.read.model_copy import ModelCopy, ServedVersion


@dataclass(frozen=True)
class CopySync:
    """Slot `slot` now holds `copy` (built, cloned, or changed beyond row writes)."""

    slot: int
    copy: ModelCopy


@dataclass(frozen=True)
class RowSync:
    """Slot `slot`'s copy was written in place: its tables (shared memory) already hold the
    rows; its id maps take `id_writes` (per table, in order) and it serves `served`."""

    slot: int
    served: ServedVersion | None
    id_writes: dict[str, list[IdMapWrite]] = field(default_factory=dict)


#: a worker's answer to a sync: None, or what went wrong.
SyncAck = str | None

#: the RPC ops a worker asks the apply side (admin endpoints, /v1/model's status).
RPC_OPS = ("status", "pin", "unpin", "catch_up")
