"""Tunables of the publishing and reading side, in one place, with their defaults.

Tests override them by passing another `Tunables` (it is a frozen dataclass: use `replace`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tunables:
    """Knobs that trade speed, memory and safety."""

    #: blobs of one version uploaded at once.
    upload_concurrency: int = 4
    #: seconds a writer lease lives without renewal.
    lease_ttl_s: float = 60.0
    #: zstd level for blob sections (applied only where it shrinks them).
    zstd_level: int = 1
    #: rows encoded per chunk (keeps codec work in cache).
    encode_chunk_rows: int = 16384
    #: manifests a catalog keeps in memory, least recently used evicted first (tens of KiB
    #: each); a restore chain longer than this is read again by the next plan that needs it.
    manifest_cache_size: int = 256
    #: most bytes restoring a version (a trainer's resume) may allocate, checked on its manifest
    #: first (publisher/memory_budget.py); None: 3/4 of the machine's memory.
    memory_budget_bytes: int | None = None
    #: bytes of a full baseline (rows and optimizer columns) the trainer copies per training
    #: step (trainer/snapshot_capture.py; a sharded job's rank of its shards,
    #: trainer/sharded/host_copies.py): 32 MiB is ~5 ms of copy on an idle core, so a 1.1 GB
    #: baseline costs ~35 short stops instead of one 0.1-1.2 s stall. None: one stop.
    full_copy_chunk_bytes: int | None = 32 << 20
    #: added to the nice value of the background publisher's threads, or of a publisher process
    #: (publisher/write/priority.py): a contended core goes to the training thread. 0 (default):
    #: unchanged; on a saturated machine a lowered publisher falls behind and publishes fewer,
    #: merged versions (measured: a live trainer on 2 busy cores).
    publisher_nice: int = 0


DEFAULT_TUNABLES = Tunables()
