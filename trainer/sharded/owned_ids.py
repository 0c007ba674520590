"""A dynamic id space over the ranks of a job: each id has an owner rank (docs/FORMAT.md 7.2).

    owners = IdOwners.gather(local_shards(dmp), group)   # who holds which rows (a collective)
    ids = OwnedIds(owners, spaces, tables, group)   # feature -> this rank's IdSpace, its table
    ids.learn("user", ["u1", "u2"])          # the reader's numbering, as IdSpace.learn
    mapped = ids.map([IdRequest("user", numbers, ts, prior=True)], now)   # every rank, every step

The owner of an id in a table is the rank holding the row `blake2b-64(key) mod rows` (its
TorchRec shard; `IdOwners.owner_of`), and the owner gives its ids rows of its own shard only
(`IdSpace(own_rows=...)`), so the id-map entries of a shard are its owner's map and the rank that
writes a shard's rows writes its id map. A step maps ids in two exchanges (an all-gather each,
`JsonGather`) over a gloo group of its own: every rank sends each feature's keys (with their
owners: each key is hashed once per numbering), their occurrences and event times; each owner
maps the occurrences of the ids it owns, all ranks' in rank order as one batch, with the
one-process `IdSpace` (admission, eviction, cold start, counts); then every owner sends back
the rows and prior counts, and each rank puts its occurrences' together. Payloads are JSON in
uint8 tensors, never pickled. Every rank calls `map` once per step, with no request when it has
no events (`idle`), as the peers wait for it.

A restored version (any world size) is re-partitioned by `IdOwners.repartition`: an id whose row
is not in its owner's shard at this world size moves, with its row, to its owner's lowest free
row (dropped when there is none); the rule is deterministic, so every rank computes the same.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch

from publisher.dlrm import TABLE_PREFIX, init_embedding_rows
from publisher.id_map import UNKNOWN_ROW, IdMap, hashed_rows
from publisher.read.restore import RestoredState, TableState
from trainer.id_space import IdRequest, IdSpace, MappedIds
from trainer.sharded.collective import FIRST_ROOM, GlooGroup, JsonGather
from trainer.sharded.local_shards import LocalShard, ShardedTable
from trainer.streams.kafka_events import KafkaEventStream

log = logging.getLogger(__name__)

Rows = npt.NDArray[np.int64]


@dataclass(frozen=True)
class IdOwners:
    """Which rank holds which rows of each table, so which rank owns each id."""

    #: table -> its shards (row_start, row_end, rank), sorted, covering [0, rows).
    shards: Mapping[str, tuple[tuple[int, int, int], ...]]

    @classmethod
    def gather(cls, tables: Mapping[str, ShardedTable], group: GlooGroup) -> IdOwners:
        """Every rank's shards of `tables` (its `local_shards`), on every rank: a collective."""
        mine: dict[str, Any] = {
            name: [[s.row_start, s.row_end] for s in table.shards] for name, table in tables.items()
        }
        shards: dict[str, list[tuple[int, int, int]]] = {name: [] for name in tables}
        for rank, part in enumerate(JsonGather(group)(mine)):
            for name, ranges in cast(dict[str, list[list[int]]], part).items():
                shards[name].extend((int(s), int(e), rank) for s, e in ranges)
        return cls({name: tuple(sorted(ranges)) for name, ranges in shards.items()})

    def own_rows(self, table: str, rank: int) -> tuple[int, int] | None:
        """The rows of `table` `rank` holds (one shard per rank and table), None: none."""
        held = [(s, e) for s, e, r in self.shards[table] if r == rank]
        return held[0] if held else None

    def owner_of(self, table: str, keys: Sequence[str]) -> npt.NDArray[np.int64]:
        """The owner rank of each of `keys` in `table`."""
        shards = self.shards[table]
        if len(shards) == 1:
            return np.full(len(keys), shards[0][2], dtype=np.int64)
        rows = hashed_rows(keys, shards[-1][1])
        return self._ranks(table)[self._shard_index(table, rows)]

    def _shard_index(self, table: str, rows: Rows) -> Rows:
        starts = np.asarray([s for s, _, _ in self.shards[table]], dtype=np.int64)
        return np.searchsorted(starts, rows, side="right") - 1

    def _ranks(self, table: str) -> Rows:
        return np.asarray([r for _, _, r in self.shards[table]], dtype=np.int64)

    def repartition(self, table: str, id_map: IdMap, state: TableState) -> tuple[int, int]:
        """Move every id of `id_map` (a whole table's, restored) whose row is not in its
        owner's shard to the lowest free row of that shard, with its row's weights and optimizer
        columns in `state` (the whole table), and re-initialise the rows it left; an id whose
        owner has no free row is dropped. Returns (moved, dropped). Deterministic."""
        held = np.flatnonzero(id_map.entries().assigned).astype(np.int64)
        if not len(held) or len(self.shards[table]) == 1:
            return 0, 0
        keys = [id_map.key_of(int(row)) or "" for row in held]
        want = self._shard_index(table, hashed_rows(keys, id_map.rows))
        have = self._shard_index(table, held)
        stray = np.flatnonzero(want != have)
        if not len(stray):
            return 0, 0
        sources = held[stray]
        offset = state.row_start
        values, aux = state.weights[sources - offset].copy(), state.aux[sources - offset].copy()
        movers = [
            (keys[i], int(id_map.counts[row]), float(id_map.last_seen[row]))
            for i, row in zip(stray.tolist(), sources.tolist(), strict=True)
        ]
        for row in sources.tolist():  # every stray id leaves first: its row may be another's room
            id_map.release(row)
        free = id_map.free_rows()
        moved = dropped = 0
        taken: list[int] = []
        for index, (start, end, _) in enumerate(self.shards[table]):
            room = free[(free >= start) & (free < end)].tolist()
            for position in np.flatnonzero(want[stray] == index).tolist():
                if not room:
                    dropped += 1
                    continue
                key, count, seen = movers[position]
                dst = room.pop(0)
                id_map.assign(key, dst)
                id_map.counts[dst], id_map.last_seen[dst] = count, seen
                state.weights[dst - offset] = values[position]
                state.aux[dst - offset] = aux[position]
                taken.append(dst - offset)
                moved += 1
        # a row a full left out (restored as zero, to be initialised) now holds a mover's values
        state.unwritten = np.setdiff1d(state.unwritten, np.asarray(taken, dtype=np.int64))
        fresh = sources[id_map.entries(sources).assigned == 0] - offset
        init_embedding_rows(torch.from_numpy(state.weights), torch.from_numpy(fresh))
        state.aux[fresh] = 0.0
        return moved, dropped


class OwnedIds:
    """This rank's part of a job's dynamic id space (the module docstring): the `IdSpace` of
    each feature whose table it holds rows of, and the exchange with the other ranks."""

    def __init__(
        self,
        owners: IdOwners,
        spaces: Mapping[str, IdSpace],
        tables: Mapping[str, str],
        group: GlooGroup,
        *,
        room: int = FIRST_ROOM,
    ) -> None:
        """`spaces`: feature -> the `IdSpace` of the ids this rank owns (`own_rows` its shard),
        for the features whose table this rank holds rows of; `tables`: feature -> its table;
        `room`: the exchange's first payload room (`JsonGather`)."""
        self.owners = owners
        self.spaces = dict(spaces)
        self.tables = dict(tables)
        self.group = group
        self._gather = JsonGather(group, room)
        self._keys: dict[str, list[str]] = {feature: [] for feature in tables}
        #: number -> its key's owner rank, per feature: each key is hashed once per numbering.
        self._owners: dict[str, npt.NDArray[np.int64]] = {
            feature: np.zeros(0, dtype=np.int64) for feature in tables
        }

    @classmethod
    def for_stream(cls, stream: KafkaEventStream, owners: IdOwners, group: GlooGroup) -> OwnedIds:
        """Make `stream` (this rank's reader of a live topic) map its ids by their owners: each
        feature's `IdSpace` holds the ids this rank owns, rows of its shard only (none for a
        table it holds no rows of)."""
        tables = {f.name: TABLE_PREFIX + f.name for f in stream.spec.features}
        spaces: dict[str, IdSpace] = {}
        for feature, table in tables.items():
            own = owners.own_rows(table, group.rank)
            if own is not None:
                spaces[feature] = IdSpace(stream.id_maps[table], stream.policy, own_rows=own)
        ids = cls(owners, spaces, tables, group)
        stream.id_spaces = spaces
        stream.id_mapper = ids
        return ids

    # --- the reader's numbering (as IdSpace's) ------------------------------------------------

    def learn(self, feature: str, keys: Sequence[str]) -> None:
        """The next numbers of `feature` name `keys`."""
        if not keys:
            return
        self._keys[feature].extend(keys)
        owners = self.owners.owner_of(self.tables[feature], keys)
        self._owners[feature] = np.concatenate([self._owners[feature], owners])

    def renumber(self) -> None:
        """Forget which keys the numbers name."""
        for keys in self._keys.values():
            keys.clear()
        for feature in self._owners:
            self._owners[feature] = np.zeros(0, dtype=np.int64)

    # --- a step -------------------------------------------------------------------------------

    def idle(self) -> None:
        """Take part in a step with no events of this rank's own."""
        self.map([], None)

    def map(self, requests: Sequence[IdRequest], now: float | None) -> list[MappedIds]:
        """Rows and prior counts of `requests`' occurrences, mapped by their owners (a
        collective: every rank calls it once per step). `now`: this rank's stream clock; the
        owners judge eviction against the latest of the ranks'."""
        sent: dict[str, Any] = {}
        mine: list[tuple[IdRequest, npt.NDArray[np.int64], npt.NDArray[np.int64]]] = []
        for request in requests:
            present = np.flatnonzero(request.numbers >= 0)
            numbers = request.numbers[present]
            unique, occurrence = np.unique(numbers, return_inverse=True)
            names = self._keys[request.feature]
            keys = [names[n] for n in unique.tolist()]
            owners = self._owners[request.feature][unique]
            mine.append((request, present, owners[occurrence]))
            sent[request.feature] = {
                "k": keys,
                "w": owners.tolist(),
                "o": occurrence.tolist(),
                "t": request.ts[present].tolist(),
                "p": request.prior,
            }
        parts = self._gather({"now": now, "f": sent})
        replies = self._gather(self._serve(parts))
        out: list[MappedIds] = []
        for request, present, owner in mine:
            rows = np.full(len(request.numbers), UNKNOWN_ROW, dtype=np.int64)
            prior = np.zeros(len(request.numbers), dtype=np.int64)
            for rank, reply in enumerate(replies):
                mapped = cast(dict[str, Any], reply).get(request.feature, {})
                got = mapped.get(str(self.group.rank))
                if got is None:
                    continue
                at = present[owner == rank]
                rows[at] = got["r"]
                if request.prior:
                    prior[at] = got["c"]
            out.append(MappedIds(rows, prior))
        return out

    def _serve(self, parts: Sequence[Any]) -> dict[str, Any]:
        """Map the occurrences of the ids this rank owns, of every rank's request, each
        feature's as one batch in rank order; the rows (and prior counts) per feature and
        rank."""
        clocks = [p["now"] for p in parts if p["now"] is not None]
        now = max(clocks) if clocks else None
        me = self.group.rank
        reply: dict[str, dict[str, dict[str, list[int]]]] = {}
        for feature, space in self.spaces.items():
            numbering: dict[str, int] = {}
            numbers: list[npt.NDArray[np.int64]] = []
            times: list[npt.NDArray[np.float64]] = []
            sources: list[tuple[int, int]] = []  # (rank, occurrences) in batch order
            prior = False
            for rank, part in enumerate(parts):
                got = part["f"].get(feature)
                if got is None or not got["k"]:
                    continue
                keys: list[str] = got["k"]
                owned = np.asarray(got["w"], dtype=np.int64) == me  # the sender hashed them
                occurrence = np.asarray(got["o"], dtype=np.int64)
                picked = np.flatnonzero(owned[occurrence])
                if not len(picked):
                    continue
                local = np.asarray(
                    [
                        numbering.setdefault(k, len(numbering)) if o else -1
                        for k, o in zip(keys, owned.tolist(), strict=True)
                    ],
                    dtype=np.int64,
                )
                numbers.append(local[occurrence[picked]])
                times.append(np.asarray(got["t"], dtype=np.float64)[picked])
                sources.append((rank, len(picked)))
                prior = prior or bool(got["p"])
            if not sources:
                continue
            space.renumber()
            space.learn(list(numbering))
            mapped = space.map(
                np.concatenate(numbers).astype(np.int32),
                np.concatenate(times),
                prior=prior,
                now=now,
            )
            out: dict[str, dict[str, list[int]]] = {}
            at = 0
            for rank, n in sources:
                out[str(rank)] = {
                    "r": mapped.rows[at : at + n].tolist(),
                    "c": mapped.prior[at : at + n].tolist(),
                }
                at += n
            reply[feature] = out
        return reply

    # --- resume ---------------------------------------------------------------------------------

    def load(self, state: RestoredState) -> None:
        """Take this rank's ids of a restored version (its id maps, whole tables): the maps
        re-partitioned for this world size first (`IdOwners.repartition`, in `state`: call it
        before the rows are loaded), then each space's map the ids whose row is in its shard."""
        for feature, space in self.spaces.items():
            table = self.tables[feature]
            restored = state.id_maps.get(table)
            if restored is None:
                continue
            moved, dropped = self.owners.repartition(table, restored, state.tables[table])
            if (moved or dropped) and self.group.rank == 0:
                log.warning(
                    "table %r: %d ids moved to a row of their owner's shard at %d ranks, %d "
                    "dropped (their owner's shard is full; docs/FORMAT.md 7.2)",
                    table,
                    moved,
                    dropped,
                    self.group.world_size,
                )
            start, end = space.own_rows
            rows = np.arange(start, end, dtype=np.int64)
            owned = IdMap(restored.rows, hashed=restored.hashed)
            owned.apply(rows, restored.entries(rows))
            space.id_map.load_from(owned)
            space.sync()


class ShardRowReset:
    """Re-initialises rows of this rank's shard of one table (an owner `IdSpace`'s
    `reset_rows`: the rows of the ids it evicts), as trainer/row_reset.py does in one process:
    weights drawn again, accumulator 0, marked dirty with `mark`."""

    def __init__(self, table: str, shard: LocalShard, mark: Any) -> None:
        """`mark(table, rows)`: marks global rows dirty (trainer/sharded/dirty_rows.py)."""
        self.table = table
        self.shard = shard
        self._mark = mark

    def mark(self, rows: Rows) -> None:
        """Mark `rows` dirty only (rows given to new ids)."""
        self._mark(self.table, rows)

    def __call__(self, rows: Rows) -> None:
        local = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64) - self.shard.row_start)
        with torch.no_grad():
            local = local.to(self.shard.weight.device)
            init_embedding_rows(self.shard.weight, local)
            self.shard.accumulator.index_fill_(0, local, 0.0)
        self._mark(self.table, rows)
