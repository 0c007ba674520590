"""The memory a version may make a process allocate, checked on its manifest before anything is.

A manifest is a few KiB of JSON that anyone who can write to the store controls, and it declares
what readers allocate: a forged one naming a 2^20 x 256 table cost every server 1 GiB and seconds
of initialisation per attempt, retried forever, and a restarted server met the same HEAD again.
Every reader that allocates from a manifest checks it here first, against one budget:

- restore, and a trainer's resume (`publisher.read.restore`), allocate the version's state in
  fp32: every table with its optimizer columns, the dense and optimizer tensors. That is
  `Manifest.restored_fp32_bytes` (every row, held or not), less the tables and rows a restore
  of some of them leaves out (a rank of a sharded job: its budget is per rank). A table with
  an id map adds the map:
  `ID_MAP_ROW_BYTES` per row, plus its keys, which come from the chain's id-map blobs, so at
  most the sum of their sizes (`id_map_restore_bytes`).
- a subscriber (`publisher.read.copy_builders`) allocates the model its sink builds for the
  version (a module's parameters and buffers, measured on the meta device before anything is
  allocated; a tensor sink's tables and dense tensors, from the manifest), plus an id map per
  table that carries one, counted full (`served_id_maps_bytes`: later versions fill it), once
  per copy its consistency scheme holds at its peak (a new model is built beside the served
  one: 2 copies, `publisher.read.consistency`); a version's tables must then match that model
  before any blob is fetched.

Not counted: what a reader holds while it works (the blobs of one version being fetched and
decoded, each capped by its manifest entry, schemas.delta_blob.BlobLimits.for_table), and the
process itself. The default budget is `DEFAULT_FRACTION` of the memory the process may use:
physical memory, or its cgroup's limit when that is lower.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from schemas.errors import BadDataError
from schemas.manifest import IDS_HELD_METRIC, Manifest, full_fp32_bytes

#: the share of the machine's memory the model state may take by default: the rest is left to
#: the interpreter, torch (~0.7 GiB), request buffers and what a reader holds while it works.
DEFAULT_FRACTION = 0.75
# cgroup v2, then v1: a container's limit, often far below the host's physical memory.
_CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


#: what rebuilding an id map in a restore allocates per row at its peak, besides the keys'
#: characters: the map (counts, last_seen, key and held arrays; per held id a dict slot, a str
#: object and a row int) and the rebuild's transient entries, arrays and second dict. Measured
#: with tracemalloc: 287 bytes per row at the peak for a 200k-row map of 12-byte keys (156
#: retained once rebuilt).
ID_MAP_ROW_BYTES = 288
#: what a hashed id map holds per row: its arrays only (it holds no keys).
HASHED_ID_MAP_ROW_BYTES = 25


class MemoryBudgetError(BadDataError):
    """A version needs more memory than the budget allows; nothing was allocated for it."""


def machine_memory_bytes() -> int:
    """The memory this process may use: physical memory, or its cgroup's limit when lower."""
    limits = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) means no limit
            limits.append(int(text))
    return min(limits)


@dataclass(frozen=True)
class MemoryBudget:
    """The most bytes one version may make a reader allocate."""

    limit_bytes: int

    def __post_init__(self) -> None:
        if self.limit_bytes < 1:
            raise ValueError(f"a memory budget must be >= 1 byte, got {self.limit_bytes}")

    @classmethod
    def of_machine(cls) -> MemoryBudget:
        """`DEFAULT_FRACTION` of `machine_memory_bytes()`."""
        return cls(int(machine_memory_bytes() * DEFAULT_FRACTION))

    @classmethod
    def from_setting(cls, limit_bytes: int | None) -> MemoryBudget:
        """The budget a setting gives: its bytes, or the machine's default when it is None."""
        return cls.of_machine() if limit_bytes is None else cls(limit_bytes)

    def check_restore(
        self,
        manifest: Manifest,
        id_map_blob_bytes: int = 0,
        rows: Mapping[str, int] | None = None,
    ) -> None:
        """Raise MemoryBudgetError unless restoring `manifest`'s state fits; `id_map_blob_bytes`
        is the size of the id-map blobs its chain reads (see `id_map_restore_bytes`). `rows`:
        table -> how many of its rows are restored, when not every row of every table (the
        tables not named are not restored; the dense and optimizer tensors always are)."""
        restored = {t.name: t.rows for t in manifest.tables} if rows is None else rows
        left_out = sum(
            full_fp32_bytes([(t.rows - restored.get(t.name, 0), t.dim, t.aux_dim)])
            for t in manifest.tables
        )
        needed = manifest.restored_fp32_bytes - left_out
        needed += id_map_restore_bytes(manifest, id_map_blob_bytes, restored)
        self._check(f"restoring version {manifest.version}", needed)

    def check_copies(self, manifest: Manifest, copy_bytes: int, copies: int) -> None:
        """Raise MemoryBudgetError unless `copies` model copies of `copy_bytes` each fit: a
        subscriber's copies of the model `manifest` describes (publisher/read/copy_builders.py
        measures one, id maps included)."""
        copies_text = "1 model copy" if copies == 1 else f"{copies} model copies"
        self._check(f"serving version {manifest.version} ({copies_text})", copies * copy_bytes)

    def _check(self, what: str, needed: int) -> None:
        if needed > self.limit_bytes:
            raise MemoryBudgetError(
                f"{what} needs {needed:,} bytes, over the memory budget of "
                f"{self.limit_bytes:,}; refused before allocating (raise the budget if the "
                "version is genuine)"
            )


def id_map_restore_bytes(
    manifest: Manifest, id_map_blob_bytes: int, rows: Mapping[str, int] | None = None
) -> int:
    """What rebuilding `manifest`'s id maps may allocate: `ID_MAP_ROW_BYTES` per row of every
    table with an id map (of the `rows` restored of each, when given: `check_restore`), plus
    the keys, whose bytes are at most `id_map_blob_bytes` (the sizes of the id-map blobs read:
    every key comes from one)."""
    restored = {t.name: t.rows for t in manifest.tables} if rows is None else rows
    mapped = sum(restored.get(t.name, 0) for t in manifest.tables if t.has_id_map)
    return mapped * ID_MAP_ROW_BYTES + id_map_blob_bytes if mapped else 0


def served_id_maps_bytes(manifest: Manifest) -> int:
    """What the id maps of one served copy of `manifest`'s model may hold: one map per table
    whose entry carries an id map, counted with an id on every row, since the versions that
    follow fill it, at the peak of writing a full version's map (`ID_MAP_ROW_BYTES`, as a
    restore's rebuild); a hashed map (its version records no `ids_held_<table>`, which only a
    dynamic map has) its arrays only (`HASHED_ID_MAP_ROW_BYTES`). Keys longer than ~12 bytes
    take more."""
    return sum(
        t.rows
        * (
            ID_MAP_ROW_BYTES
            if IDS_HELD_METRIC + t.name in manifest.metrics
            else HASHED_ID_MAP_ROW_BYTES
        )
        for t in manifest.tables
        if t.has_id_map
    )
