"""Host copies of the rows of a rank's shards: planned rows in one stop, a full in chunks.

A delta copies the planned rows of each shard (weights and the accumulator column) in one stop.
A full baseline copies every row, which for a rank holding a few GB is seconds, and the ranks
meet at every step's collectives, so one rank's stop stalls the whole job. `ChunkedShardFull`
therefore copies a full in chunks of about `Tunables.full_copy_chunk_bytes`, one chunk per
training step, while TorchRec's tracker keeps recording lookups; the checkpointer's last stop
copies the rows changed since the first chunk again, over their chunk copies
(trainer/sharded/checkpointing.py). A row not changed since then holds the same value now as
when its chunk was copied, so the copy is the shards at that last stop, exactly.

Chunks follow the tables in order, each a list of shard-local row ranges of about `chunk_bytes`:

    table:   | user (rows of this rank)        | item                  |
    chunks:  |  0  |  1  |  2  |  3  |  4  |  5  |  6  |  7  |  8  | 9 |
                                       ^ a chunk may end one table and start the next

A GPU shard's rows go to pinned host buffers (`RowBufferPool(pinned=True)`) by asynchronous
copies: the caller synchronises once per stop (`ShardRowCopier.synchronize`), after every
table's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from publisher.id_map import IdMap
from publisher.write.snapshot import TableRows
from publisher.write.tracker import RowIds
from trainer.errors import CheckpointError
from trainer.row_buffers import RowBufferPool
from trainer.sharded.local_shards import LocalShard, ShardedTable
from trainer.sharded.training_group import shard_devices


def row_bytes(dim: int) -> int:
    """Host bytes of one row of a shard: its float32 weights and its accumulator."""
    return 4 * (dim + 1)


class ShardRowCopier:
    """Copies rows of this rank's shards into host memory (pinned, from a GPU)."""

    def __init__(self, tables: Mapping[str, ShardedTable], codec: str) -> None:
        """`tables`: this rank's `local_shards`; `codec`: the one every table is encoded with."""
        self.tables = dict(tables)
        self.codec = codec
        #: the GPUs the shards live on: their rows are copied into pinned host buffers
        #: (`gather`), and `synchronize` waits for each.
        self.devices = shard_devices(self.tables)
        self.on_gpu = bool(self.devices)
        self.buffers = RowBufferPool(pinned=self.on_gpu)
        #: table -> the id map of this rank's shard (a dynamic id space's owner map): its
        #: entries of the copied rows go with them (docs/FORMAT.md 7.2).
        self.id_maps: dict[str, IdMap] = {}

    def reserve_full(self) -> None:
        """Allocate and touch the host buffers of one full copy of this rank's shards now, for
        `ChunkedShardFull`: memory touched for the first time costs a page fault per 4 KiB,
        which makes a 32 MiB chunk copy ~75 ms instead of ~3 ms (measured on this 2-core VM),
        and pinning GBs of host memory for a GPU takes longer still. The first full would
        allocate them anyway, and the pool keeps them for the next."""
        for name, table in self.tables.items():
            for shard in table.shards:
                self.buffers.reserve(_weights(name), shard.rows, table.dim)
                self.buffers.reserve(_accumulators(name), shard.rows, 1)

    def synchronize(self) -> None:
        """Wait for the device-to-host copies issued so far (nothing to wait for on CPU)."""
        for device in self.devices:  # not only the current device: the shards' own
            torch.cuda.synchronize(device)

    def rows(self, table: ShardedTable, planned: RowIds | None) -> TableRows | None:
        """Copies of this rank's planned rows of `table` (None: all of them) and their
        accumulators; None when this rank holds none of the table. On a GPU the copies land
        at the next `synchronize`."""
        if not table.shards:
            return None
        (shard,) = table.shards  # one per rank and table (see dirty_rows.py)
        if planned is None:
            ids = np.arange(shard.row_start, shard.row_end, dtype=np.int64)
        else:
            lo, hi = np.searchsorted(planned, [shard.row_start, shard.row_end])
            ids = np.ascontiguousarray(planned[lo:hi], dtype=np.int64)
        values, aux = self.gather(table.name, shard, torch.from_numpy(ids - shard.row_start))
        return self.table_rows(table, ids, values, aux)

    def table_rows(
        self, table: ShardedTable, ids: np.ndarray, values: np.ndarray, aux: np.ndarray
    ) -> TableRows:
        """Rows `ids` (global) of this rank's shard of `table`, copied into `values`, `aux`."""
        (shard,) = table.shards
        id_map = self.id_maps.get(table.name)
        return TableRows(
            name=table.name,
            table_rows=table.rows,
            codec=self.codec,
            row_ids=ids,
            values=values,
            aux=aux,
            id_entries=None if id_map is None else id_map.capture(ids),
            row_range=None if table.whole else (shard.row_start, shard.row_end),
        )

    def gather(
        self, name: str, shard: LocalShard, local: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows `local` (shard-local) of `shard` and their accumulators, as (n, dim) and (n, 1)
        host arrays. From a GPU: gathered on the device and copied asynchronously into pinned
        buffers kept between snapshots, landed at the next `synchronize`."""
        if not shard.weight.is_cuda:
            values = shard.weight.detach().index_select(0, local).numpy()
            aux = shard.accumulator.detach().index_select(0, local).reshape(-1, 1).numpy()
            return values, aux
        on_device = local.to(shard.weight.device)
        n = int(local.numel())
        values = self.buffers.take(_weights(name), n, int(shard.weight.shape[1]))
        aux = self.buffers.take(_accumulators(name), n, 1)
        picked = shard.weight.detach().index_select(0, on_device)
        torch.from_numpy(values).copy_(picked, non_blocking=True)
        picked_acc = shard.accumulator.detach().index_select(0, on_device).reshape(-1, 1)
        torch.from_numpy(aux).copy_(picked_acc, non_blocking=True)
        return values, aux


def _weights(name: str) -> str:
    """The buffer pool's key of a table's row copies."""
    return f"{name}.weight"


def _accumulators(name: str) -> str:
    """The buffer pool's key of a table's accumulator copies."""
    return f"{name}.accumulator"


@dataclass(frozen=True)
class ChunkPart:
    """Shard-local rows [start, stop) of one table: a chunk's piece of it."""

    table: str
    start: int
    stop: int


def chunk_plan(tables: Mapping[str, ShardedTable], chunk_bytes: int) -> list[list[ChunkPart]]:
    """This rank's shards cut into chunks of at most `chunk_bytes` (`row_bytes` a row; a row
    larger than that is a chunk of its own), table after table in order."""
    if chunk_bytes < 1:
        raise CheckpointError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    chunks: list[list[ChunkPart]] = []
    current: list[ChunkPart] = []
    budget = chunk_bytes
    for name, table in tables.items():
        if not table.shards:
            continue
        (shard,) = table.shards  # one per rank and table (see dirty_rows.py)
        rows, size = shard.rows, row_bytes(table.dim)
        start = 0
        while start < rows:
            fits = budget // size
            if fits < 1 and current:  # this chunk is full: the next one starts here
                chunks.append(current)
                current, budget = [], chunk_bytes
                continue
            n = min(rows - start, max(fits, 1))
            current.append(ChunkPart(name, start, start + n))
            budget -= n * size
            start += n
    if current:
        chunks.append(current)
    return chunks


class ChunkedShardFull:
    """Every row of this rank's shards in host buffers, copied chunk by chunk (`chunk_plan`),
    then brought to the shards' state at a later stop by `refresh`."""

    def __init__(
        self,
        tables: Mapping[str, ShardedTable],
        chunks: list[list[ChunkPart]],
        copier: ShardRowCopier,
    ) -> None:
        """Allocates the host buffers (one full copy of the rank's shards); copies nothing."""
        self.tables = {name: t for name, t in tables.items() if t.shards}
        self.chunks = chunks
        self.copier = copier
        self.values: dict[str, np.ndarray] = {}
        self.aux: dict[str, np.ndarray] = {}
        for name, table in self.tables.items():
            rows = table.shards[0].rows
            pool = copier.buffers
            self.values[name] = pool.take(_weights(name), rows, table.dim, exact=True)
            self.aux[name] = pool.take(_accumulators(name), rows, 1, exact=True)
        self._next = 0

    @property
    def copied(self) -> bool:
        """Whether every chunk has been copied."""
        return self._next == len(self.chunks)

    def copy_chunk(self) -> int:
        """Copy the next chunk, if any is left (from a GPU: landed at the copier's next
        `synchronize`); the bytes copied."""
        if self.copied:
            return 0
        copied = 0
        for part in self.chunks[self._next]:
            shard = self.tables[part.table].shards[0]
            rows = slice(part.start, part.stop)
            torch.from_numpy(self.values[part.table][rows]).copy_(
                shard.weight.detach()[rows], non_blocking=True
            )
            torch.from_numpy(self.aux[part.table][rows]).copy_(
                shard.accumulator.detach()[rows].reshape(-1, 1), non_blocking=True
            )
            copied += (part.stop - part.start) * row_bytes(self.tables[part.table].dim)
        self._next += 1
        return copied

    def refresh(self, changed: Mapping[str, RowIds]) -> None:
        """Copy the chunks left, then `changed` (global rows of this rank's shards, per table:
        those changed since the first chunk) again over their chunk copies, with one
        synchronisation."""
        while not self.copied:
            self.copy_chunk()
        fresh: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]] = []
        for name, table in self.tables.items():
            shard = table.shards[0]
            ids = changed.get(name)
            if ids is None or len(ids) == 0:
                continue
            local = np.asarray(ids, dtype=np.int64) - shard.row_start
            fresh.append((name, local, *self.copier.gather(name, shard, torch.from_numpy(local))))
        self.copier.synchronize()
        for name, rows, values, aux in fresh:
            self.values[name][rows] = values
            self.aux[name][rows] = aux

    def table_rows(self) -> tuple[TableRows, ...]:
        """Every row of this rank's shards, as copied (call after `refresh`)."""
        return tuple(
            self.copier.table_rows(
                table,
                np.arange(table.shards[0].row_start, table.shards[0].row_end, dtype=np.int64),
                self.values[name],
                self.aux[name],
            )
            for name, table in self.tables.items()
        )
