"""A job of several ranks publishing its versions as one writer (docs/FORMAT.md section 2.1).

    collectives = ThreadCollective.group(2, timeout_s=60)     # or TorchCollective per process
    job = JobPublisher(store, "movielens", collectives[rank], announce=bus.announce)
    result = job.publish(snapshot)        # on every rank, each with its own tables or shards

Rank 0 holds the job's `VersionWriter` (probe, lease, HEAD); every rank encodes and uploads its
own blobs, in parallel with the others. One `publish` is one round in which every rank takes
part in every collective call, whatever fails:

    rank 0                                      every rank
    reserve(): V and its parent
    broadcast {V, token, rank 0's header}   ->  check its header agrees with rank 0's, encode
                                                and put its blobs under .../VVVV-TOKEN/rRRRR/
    gather                                  <-  {part, position} once every put returned, or
                                                {error}
    commit_parts (only if every rank
    reported a part): manifest, HEAD
    broadcast {key, manifest} or {error}    ->  PublishResult, or RankFailedError

So a version is committed only after every rank's blobs are durable, and every rank learns the
same outcome: the version, or `RankFailedError` naming the rank that failed and its error,
with HEAD left where it was (the blobs already put are orphans for `checknrun gc`). After a
`RankFailedError` every rank has finished its round, so the next `publish` may try again; after
a `CollectiveError` (a rank did not answer: dead, or stuck past the collective's timeout) a
rank may still be writing, so the publisher refuses to go on and rank 0 stops the job.

`BackgroundPublisher` (publisher/write/background.py) runs the rounds on a background thread at
any world size: rank 0 picks the newest snapshot sequence it has, and the others fold theirs up
to it, so each version holds the same training step on every rank; a round that failed because
the store was unreachable (`RankFailedError.retryable`, the same on every rank) is tried again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from publisher.codecs import encode_rows
from publisher.dlrm import TABLE_PREFIX, DLRMConfig
from publisher.read.catalog import VersionRef
from publisher.release.gate import GateWord, ReleaseGate
from publisher.release.rules import GateConfig
from publisher.served_loss import ServedModel
from publisher.store import ObjectStore
from publisher.tunables import DEFAULT_TUNABLES, Tunables
from publisher.write.collective import (
    Collective,
    CollectiveError,
    JSONValue,
    SoloCollective,
    ThreadCollective,
)
from publisher.write.policies import ServedLossCodecRule
from publisher.write.publishing import (
    PublishResult,
    encode_table,
)
from publisher.write.row_transfer import (
    largest_magnitudes,
    merge_rank_rows,
    rows_from_bytes,
    rows_to_bytes,
)
from publisher.write.served_codec import CodecChoice, ServedCodec
from publisher.write.snapshot import NonFiniteSnapshotError, Snapshot, TableRows
from publisher.write.version_writer import (
    BlobsDraft,
    Reservation,
    VersionHeader,
    VersionWriter,
    WrittenPart,
    upload_part,
)
from schemas.announcement import Announcement
from schemas.errors import BadDataError, CheckNRunError, UnavailableError
from schemas.manifest import Manifest, Position, RankPosition, ServedLoss
from schemas.release import RELEASE_GATE_METRIC
from schemas.tensor_blob import encode_tensors, tensor_bytes

log = logging.getLogger(__name__)


class RankFailedError(CheckNRunError):
    """A rank of the job failed its part of a version (or rank 0 its commit): nothing was
    committed. Every rank raises it, naming the same rank and error."""

    def __init__(self, rank: int, error: str, retryable: bool = False) -> None:
        super().__init__(f"rank {rank} failed: {error}; nothing was committed")
        self.rank = rank
        self.error = error
        #: the rank could not reach the store: the same round may be tried again.
        self.retryable = retryable


def retryable(exc: BaseException) -> bool:
    """True for a round that failed because the store (or broker) could not be reached: the
    same snapshot may be published again. A rank that did not answer is not: the job stops."""
    if isinstance(exc, CollectiveError):
        return False
    if isinstance(exc, RankFailedError):
        return exc.retryable
    return isinstance(exc, UnavailableError | ConnectionError | TimeoutError)


class JobMismatchError(BadDataError):
    """The ranks do not agree on what a version is (kind, reference point, policy, snapshot
    sequence, step or model): their snapshots are not of the same job's interval."""


def table_order(model_config: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The model's tables in its own order (what every rank knows), from a DLRM config; None
    for a config this module cannot read (the tables are then ordered by name)."""
    try:
        config = DLRMConfig.from_json(model_config)
    except ValueError:
        return None
    return tuple(TABLE_PREFIX + f.name for f in config.sparse)


def _header(snapshot: Snapshot) -> dict[str, JSONValue]:
    """What every rank must agree on for one version, as JSON."""
    agreed: dict[str, JSONValue] = json.loads(
        json.dumps(
            {
                "kind": snapshot.kind,
                "relative_to": snapshot.relative_to,
                "policy": snapshot.policy,
                "sequence": snapshot.sequence,
                "step": snapshot.position.step,
                "model_config": snapshot.model_config,
            }
        )
    )
    return agreed


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class JobPublisher:
    """Publishes one job's versions: `publish` is a collective call every rank makes.

    Rank 0 owns the `VersionWriter` (taken here: every rank learns if it could not be);
    `announce` is called on rank 0 once a version is committed. A round: rank 0 reserves the
    version; every rank checks its part is finite (all refuse together); rank 0 judges the
    served loss and codec (publisher/write/served_codec.py) on every rank's rows; every rank
    encodes and uploads its part; rank 0 commits them as one version.

    One process is a one-part job (`CheckpointPublisher`: this class over a `SoloCollective`):
    the same rounds, with nothing to exchange; its part is the version (the blobs keyed as one
    writer's, no `position.ranks`), and a failure is raised as itself rather than as the
    job's `RankFailedError`, so `BackgroundPublisher` can retry a store that is down.
    """

    def __init__(
        self,
        store: ObjectStore,
        model: str,
        collective: Collective,
        *,
        announce: Callable[[Announcement], None] | None = None,
        tunables: Tunables = DEFAULT_TUNABLES,
        timeout_s: float = 300.0,
        writer: VersionWriter | None = None,
        served: ServedCodec | None = None,
    ) -> None:
        """`served`: rank 0's judge of the served loss and `--codec auto`'s codec (every rank
        passes one that judges, or none does: its rounds are collective calls)."""
        self.store = store
        self.model = model
        self.collective = collective
        self.rank = collective.rank
        self.announce = announce
        self.tunables = tunables
        #: the judge of the served loss and codec (one that judges nothing when not given).
        self.served = served or ServedCodec(encode_table, tunables=tunables)
        #: one process (a `SoloCollective`): failures raised as themselves, nothing exchanged,
        #: its version a single writer's. (A job of one rank stays a job: `position.ranks`.)
        self.solo = isinstance(collective, SoloCollective)
        #: one process's verdict, whose blobs its upload reuses.
        self._judged: CodecChoice | None = None
        #: how long a rank waits for its own trainer's snapshot of the sequence rank 0 picked
        #: (BackgroundPublisher): a trainer that far behind the others has stopped.
        self.timeout_s = timeout_s
        self.writer: VersionWriter | None = None
        #: the CollectiveError that ended the job's publishing, re-raised by every later call.
        self._broken: CollectiveError | None = None
        #: rank 0's reservation of the round in progress.
        self._reservation: Reservation | None = None
        failure: JSONValue = None
        if self.solo:
            self.writer = writer or VersionWriter(store, model, tunables=tunables)
            return
        if self.rank == 0:
            try:
                self.writer = writer or VersionWriter(store, model, tunables=tunables)
            except CheckNRunError as exc:
                failure = _describe(exc)
                told = self._call(lambda: collective.broadcast(failure))
                raise RankFailedError(0, str(told)) from exc
        told = self._call(lambda: collective.broadcast(failure))
        if told is not None:
            raise RankFailedError(0, str(told))

    def _call(self, operation: Callable[[], Any]) -> Any:
        """Run a collective call; a CollectiveError ends this publisher for good."""
        if self._broken is not None:
            raise self._broken
        try:
            return operation()
        except CollectiveError as exc:
            self._broken = exc
            if self.writer is not None:
                self.writer.close()  # rank 0 stops the job: the lease goes with it
            raise

    def next_sequence(self, sequence: int | None) -> int | None:
        """Rank 0's `sequence` on every rank (the others pass None): which snapshot the next
        round publishes, None when there are no more rounds (BackgroundPublisher)."""
        told = self._call(lambda: self.collective.broadcast(sequence if self.rank == 0 else None))
        return None if told is None else _int(told)

    def publish(self, snapshot: Snapshot) -> PublishResult:
        """Publish this rank's `snapshot` as its part of the job's next version (every rank
        calls it, each with its own snapshot); return the committed version.

        Raises RankFailedError (the same on every rank) when a rank's part or the commit
        failed, CollectiveError when a rank did not answer in time."""
        # A full of a table with a dynamic id map carries the rows its ids hold (FORMAT.md 7.1).
        return self._round(snapshot.held_rows(), None)

    def fail(self, error: BaseException) -> None:
        """Take part in the job's next round only to fail it with `error` (a rank that has no
        snapshot to give): every rank then raises RankFailedError naming this rank."""
        self._round(None, error)

    def _round(self, snapshot: Snapshot | None, error: BaseException | None) -> PublishResult:
        started = time.perf_counter()
        plan = _dict(self._call(lambda: self.collective.broadcast(self._reserve(snapshot))))
        if "error" in plan:
            raise RankFailedError(0, str(plan["error"]), plan.get("retry") is True)
        largest = self._check_finite(snapshot if error is None else None)
        judging = time.perf_counter()
        verdict = self._judge(snapshot if error is None else None)
        judged_s = time.perf_counter() - judging  # encoding the version to measure it
        encoded_s = 0.0
        report: JSONValue
        try:
            if error is not None:
                raise error
            assert snapshot is not None
            reservation = Reservation(
                self.model, _int(plan["version"]), str(plan["token"]), None, None
            )
            assert largest is not None
            codec = verdict.get("codec")
            report, encoded_s = self._upload(
                snapshot, plan, reservation, largest, None if codec is None else str(codec)
            )
            encoded_s += judged_s
        except Exception as exc:  # every rank must take part in the rounds whatever failed
            if self.solo:
                raise
            log.exception("rank %d: its part of the version failed", self.rank)
            report = {"error": _describe(exc), "retry": retryable(exc)}
        reports = self._call(lambda: self.collective.gather(report))
        served_loss = verdict.get("served_loss")
        judged = None if served_loss is None else ServedLoss.model_validate(served_loss)
        outcome = _dict(
            self._call(lambda: self.collective.broadcast(self._commit(reports, snapshot, judged)))
        )
        if "error" in outcome:
            raise RankFailedError(
                _int(outcome["rank"]), str(outcome["error"]), outcome.get("retry") is True
            )
        manifest = Manifest.from_json(str(outcome["manifest"]).encode())
        ref = VersionRef(manifest, str(outcome["key"]))
        if self.rank == 0:
            self.served.observe(ref, judged)
        if self.rank == 0 and self.announce is not None:
            try:
                self.announce(Announcement.of(manifest, ref.key))
            except Exception:
                log.exception("announcing version %d failed; subscribers will poll", ref.version)
        assert snapshot is not None  # a round this rank failed raised above
        return PublishResult(
            ref=ref,
            encode_s=encoded_s,
            commit_s=time.perf_counter() - started - encoded_s,
            merged=snapshot.merged,
            taken_at=snapshot.taken_at,
            sequence=snapshot.sequence,
            measure_s=float(_number(verdict.get("measure_s", 0.0))),
            reencoded=tuple(
                (str(c), float(_number(loss))) for c, loss in _pairs(verdict.get("reencoded"))
            ),
            gate=GateWord.from_json(verdict.get("gate")),
        )

    def _check_finite(self, snapshot: Snapshot | None) -> dict[str, float] | None:
        """Every rank checks its snapshot before anything is written; NonFiniteSnapshotError on
        every rank alike when one holds NaN or inf (the reservation writes nothing, so the
        round ends there: the job stops, or holds the version back and folds it into the
        next, as `BackgroundPublisher.on_non_finite` says). Returns each table's largest
        magnitude (None without a snapshot)."""
        refused: JSONValue = None
        largest = None
        if snapshot is not None:
            try:
                largest = snapshot.check_finite()
            except NonFiniteSnapshotError as exc:
                if self.solo:
                    raise
                refused = str(exc)
        said = self._call(lambda: self.collective.gather(refused))
        first: JSONValue = None
        if said is not None:
            first = next(
                ({"rank": r, "error": e} for r, e in enumerate(said) if e is not None), None
            )
        told = self._call(lambda: self.collective.broadcast(first))
        if told is not None:
            found = _dict(told)
            raise NonFiniteSnapshotError(f"rank {found['rank']}: {found['error']}")
        return largest

    def _judge(self, snapshot: Snapshot | None) -> dict[str, JSONValue]:
        """Rank 0's verdict on the round's version, the same on every rank: the codec every
        rank encodes its rows with and what the version loses as served (publisher/write/
        served_codec.py), judged on the rows every rank sends it (publisher/write/
        row_transfer.py); {} when the job does not judge, or a rank has no rows to send (its
        upload then fails the round, saying why)."""
        if not self.served.judges:
            return {}
        if self.solo:
            if snapshot is None:
                return {}
            return self._verdict(snapshot, snapshot.tables)
        data = b""
        try:
            if snapshot is not None:
                snapshot.check_finite()
                data = rows_to_bytes(snapshot.tables)
        except Exception:  # refused again, and reported, by this rank's upload
            data = b""
        parts = self._call(lambda: self.collective.gather_bytes(data))
        verdict: JSONValue = None
        if self.rank == 0:
            verdict = {}
            assert parts is not None
            if snapshot is not None and all(parts):
                try:
                    rows = merge_rank_rows([rows_from_bytes(p) for p in parts])
                    verdict = self._verdict(snapshot, rows)
                except Exception:
                    log.exception("rank 0: the served loss of this version was not measured")
        return _dict(self._call(lambda: self.collective.broadcast(verdict)))

    def _verdict(self, snapshot: Snapshot, rows: Sequence[TableRows]) -> dict[str, JSONValue]:
        """What rank 0 judges the version's `rows` (the whole version's) cost as served, and
        their codec; one process keeps the blobs the judge encoded for its upload."""
        choice = self.served.choose(snapshot, rows, largest_magnitudes(rows))
        if self.solo:
            self._judged = choice
        loss = choice.served_loss
        return {
            "codec": choice.codec,
            "served_loss": None if loss is None else loss.model_dump(mode="json"),
            "reencoded": [[codec, value] for codec, value in choice.reencoded],
            "measure_s": choice.measure_s,
            "gate": None if choice.gate is None else dict(choice.gate.to_json()),
        }

    def _reserve(self, snapshot: Snapshot | None) -> JSONValue:
        """Rank 0's plan of the round: the reserved version and its header (None elsewhere)."""
        if self.rank != 0:
            return None
        assert self.writer is not None
        try:
            if snapshot is None:
                raise JobMismatchError("rank 0 has no snapshot for this round")
            reservation = self.writer.reserve()
            reservation.check_kind(snapshot.kind)
        except Exception as exc:
            if self.solo:
                raise
            return {"error": _describe(exc), "retry": retryable(exc)}
        self._reservation = reservation
        return {
            "version": reservation.version,
            "token": reservation.token,
            "header": _header(snapshot),
        }

    def _upload(
        self,
        snapshot: Snapshot,
        plan: dict[str, JSONValue],
        reservation: Reservation,
        largest: Mapping[str, float],
        codec: str | None = None,
    ) -> tuple[JSONValue, float]:
        """This rank's report of the round: its part, once durable, and its position; `codec`:
        what rank 0's verdict gave every table (None: the snapshot's own); `largest`: each
        table's largest magnitude (the finite check's)."""
        started = time.perf_counter()
        mine = _header(snapshot)
        theirs = _dict(plan["header"])
        if mine != theirs:
            differ = sorted(k for k in mine if mine[k] != theirs.get(k))
            raise JobMismatchError(
                f"rank {self.rank} disagrees with rank 0 on {differ}: "
                f"{ {k: mine[k] for k in differ} } against { {k: theirs.get(k) for k in differ} }"
            )
        if self.rank != 0 and (snapshot.dense or snapshot.optimizer):
            raise JobMismatchError(f"rank {self.rank} sent dense state; rank 0 holds it")
        order = table_order(snapshot.model_config) or sorted(t.name for t in snapshot.tables)
        unknown = sorted({t.name for t in snapshot.tables} - set(order))
        if unknown:
            raise JobMismatchError(f"tables {unknown} are not the model's {list(order)}")
        judged, self._judged = self._judged, None
        if judged is not None:  # one process: the judge encoded the whole version already
            tables = judged.tables
        else:
            rows = snapshot.tables
            if codec is not None:
                rows = tuple(replace(t, codec=codec) for t in rows)
            tables = [
                encode_table(
                    t,
                    self.tunables,
                    encode_rows(t.codec, t.values, checked_finite=True, max_abs=largest[t.name]),
                )
                for t in rows
            ]
        dense = encode_tensors(snapshot.dense) if snapshot.dense else None
        optimizer = (
            encode_tensors(snapshot.optimizer, snapshot.optimizer_meta)
            if snapshot.optimizer or snapshot.optimizer_meta
            else None
        )
        blobs = BlobsDraft(
            tables=tables,
            dense=dense,
            optimizer=optimizer,
            dense_tensor_bytes=None if dense is None else tensor_bytes(dense),
            optimizer_tensor_bytes=None if optimizer is None else tensor_bytes(optimizer),
        )
        encoded_s = time.perf_counter() - started
        if self.solo:  # one writer's blobs, keyed as VersionWriter.commit keys them
            assert self.writer is not None
            part = self.writer.upload(reservation, blobs)
        else:
            part = upload_part(
                self.store,
                reservation,
                self.rank,
                blobs,
                tunables=self.tunables,
                table_index={name: i for i, name in enumerate(order)},
            )
        position = snapshot.position
        report: JSONValue = {
            "part": part.model_dump(mode="json"),
            "position": {
                "samples_seen": position.samples_seen,
                "reader": position.model_dump(mode="json")["reader"],
            },
        }
        return report, encoded_s

    def _commit(
        self,
        reports: list[JSONValue] | None,
        snapshot: Snapshot | None,
        served_loss: ServedLoss | None = None,
    ) -> JSONValue:
        """Rank 0's outcome of the round: the committed version, or the first failure."""
        if self.rank != 0:
            return None
        assert reports is not None and self.writer is not None
        for rank, report in enumerate(reports):
            if "error" in _dict(report):
                return {"rank": rank, **_dict(report)}
        assert snapshot is not None  # rank 0's own report would be an error otherwise
        try:
            ref = self._commit_parts(reports, snapshot, served_loss)
        except Exception as exc:
            if self.solo:
                raise
            log.exception("rank 0: committing the job's version failed")
            return {"rank": 0, "error": _describe(exc), "retry": retryable(exc)}
        return {"key": ref.key, "manifest": ref.manifest.to_json().decode()}

    def _commit_parts(
        self, reports: list[JSONValue], snapshot: Snapshot, served_loss: ServedLoss | None
    ) -> VersionRef:
        assert self.writer is not None and self._reservation is not None
        parts: list[WrittenPart] = []
        ranks: list[RankPosition] = []
        for rank, sent in enumerate(reports):
            report = _dict(sent)
            part = WrittenPart.model_validate(report["part"])
            if part.rank != (None if self.solo else rank):
                raise JobMismatchError(f"rank {rank} reported the part of rank {part.rank}")
            parts.append(part)
            ranks.append(RankPosition.model_validate({"rank": rank, **_dict(report["position"])}))
        # one process: the version is its one part, as one writer commits it (no ranks)
        position = snapshot.position
        if not self.solo:
            position = Position(
                step=snapshot.position.step,
                samples_seen=sum(r.samples_seen for r in ranks),
                reader=job_reader([r.reader for r in ranks]),
                ranks=tuple(ranks),
            )
        header = VersionHeader(
            kind=snapshot.kind,
            relative_to=snapshot.relative_to,
            policy=snapshot.policy,
            position=position,
            model_config=snapshot.model_config,
            metrics=_version_metrics(snapshot, gated=self.served.gate is not None),
            served_loss=served_loss,
        )
        if self.solo:
            return self.writer.commit_parts(self._reservation, header, parts)
        names = sorted({t.name for p in parts for t in p.tables})
        order = table_order(snapshot.model_config) or names
        return self.writer.commit_parts(self._reservation, header, parts, order)

    def close(self) -> None:
        """Release the job's lease (rank 0); the other ranks hold nothing."""
        if self.writer is not None:
            self.writer.close()


class CheckpointPublisher(JobPublisher):
    """One process's publisher: a one-part job (`JobPublisher` over a `SoloCollective`).

    `publish` encodes, commits and announces one snapshot and returns the committed version;
    NonFiniteSnapshotError (nothing written) when the snapshot holds NaN or inf. With
    `measure_served_loss`, each version's manifest records what quantization costs it as a
    server holds it (publisher/served_loss.py), scored on the samples its snapshot carries: on
    the built-in DLRM rebuilt from the snapshot's `model_config`, or as `served_model` says
    (any model: its served copy and `score`). With `codec_rule` (`--codec auto`), that
    measurement picks the codec of every table of the next version, whatever codec the
    snapshot names. With `gate`, each version is judged on the next snapshot's fresh samples
    and released, held or rolled back (publisher/release/gate.py): it needs the served loss
    measured.
    """

    def __init__(
        self,
        store: ObjectStore,
        model: str,
        *,
        announce: Callable[[Announcement], None] | None = None,
        writer: VersionWriter | None = None,
        tunables: Tunables = DEFAULT_TUNABLES,
        measure_served_loss: bool = False,
        codec_rule: ServedLossCodecRule | None = None,
        served_model: ServedModel | None = None,
        gate: GateConfig | None = None,
    ) -> None:
        served = ServedCodec(
            encode_table,
            measure_served_loss=measure_served_loss,
            codec_rule=codec_rule,
            served_model=served_model,
            tunables=tunables,
            gate=None if gate is None else ReleaseGate(store, model, gate, announce=announce),
        )
        super().__init__(
            store,
            model,
            SoloCollective(),
            announce=announce,
            tunables=tunables,
            writer=writer,
            served=served,
        )


def _version_metrics(snapshot: Snapshot, *, gated: bool = False) -> dict[str, float]:
    """The manifest's metrics: the snapshot's, with `snapshots` when it folds several (its
    window metrics are then the newest one's; docs/FORMAT.md section 3), and `release_gate`
    1.0 when a release gate judges the model's versions (FORMAT.md 9.4: released followers then
    wait for RELEASED instead of serving HEAD)."""
    metrics = dict(snapshot.metrics)
    if snapshot.merged > 1:
        metrics["snapshots"] = float(snapshot.merged)
    if gated:
        metrics[RELEASE_GATE_METRIC] = 1.0
    return metrics


def _int(value: JSONValue) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise JobMismatchError(f"expected an integer, got {value!r}")
    return value


def _dict(value: JSONValue) -> dict[str, JSONValue]:
    if not isinstance(value, dict):
        raise JobMismatchError(f"expected a JSON object, got {value!r}")
    return value


def _number(value: JSONValue) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise JobMismatchError(f"expected a number, got {value!r}")
    return float(value)


def _pairs(value: JSONValue) -> list[tuple[JSONValue, JSONValue]]:
    """A JSON list of [a, b] pairs (None: none)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, list) and len(v) == 2 for v in value):
        raise JobMismatchError(f"expected a list of pairs, got {value!r}")
    return [(v[0], v[1]) for v in value if isinstance(v, list)]


__all__ = [
    "Collective",
    "CollectiveError",
    "JSONValue",
    "JobMismatchError",
    "JobPublisher",
    "RankFailedError",
    "ThreadCollective",
    "retryable",
    "table_order",
]


Reader = dict[str, int | str | dict[str, int]]


def job_reader(readers: Sequence[Mapping[str, int | str | dict[str, int]]]) -> Reader:
    """The job's reader position, the union of its ranks' (docs/FORMAT.md section 3.3): rank
    0's, with the offsets of every rank's Kafka partitions (each rank reads its own); a file
    reader is the same on every rank."""
    union = dict(readers[0])
    parts = [r["offsets"] for r in readers if isinstance(r.get("offsets"), dict)]
    if parts:
        offsets: dict[str, int] = {}
        for part in parts:
            assert isinstance(part, dict)
            offsets.update(part)
        # partition numbers in numeric order, as a single process writes them
        union["offsets"] = dict(sorted(offsets.items(), key=lambda item: (len(item[0]), item[0])))
    return union
