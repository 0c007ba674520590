"""What a version costs as served, and the codec `--codec auto` gives it: one judge for one process
and for a job's rank 0.

    judge = ServedCodec(measure_served_loss=True, codec_rule=rule)
    choice = judge.choose(snapshot, snapshot.tables, largest)   # encodes while it measures
    ...commit choice.tables with choice.served_loss...
    judge.observe(ref, choice.served_loss)                     # the rule's next codec; the gate

The served-loss copy (publisher/served_loss.py) is overlaid with the version's fp32 rows, the
kept samples scored, the rows encoded with the codec, decoded into the copy and the samples
scored again; `codec_rule` steps the codec up and encodes the same rows again while the loss is
over its budget. `CheckpointPublisher` (one process) keeps the blobs `choose` encoded and
commits them. A sharded job's rank 0 (publisher/write/job_publishing.py) judges the rows every
rank gathered to it, then each rank encodes its own part with the codec chosen: the judge needs
the whole version's rows, which only the job as a whole holds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from publisher.codecs import QuantizedRows, decode_rows, encode_rows
from publisher.read.catalog import VersionRef
from publisher.release.gate import GateWord, ReleaseGate
from publisher.served_loss import Fp32Scores, ServedLossMeter, ServedModel
from publisher.tunables import DEFAULT_TUNABLES, Tunables
from publisher.write.policies import ServedLossCodecRule
from publisher.write.snapshot import Snapshot, TableRows
from publisher.write.version_writer import TableBlob
from schemas.manifest import ServedLoss

log = logging.getLogger(__name__)


class TableEncoder(Protocol):
    """How one table's rows become its blob (publisher/write/publishing.py `encode_table`)."""

    def __call__(
        self, rows: TableRows, tunables: Tunables, quantized: QuantizedRows | None
    ) -> TableBlob: ...


@dataclass(frozen=True)
class CodecChoice:
    """The rows with the codec chosen, their blobs, and what the version loses as served."""

    rows: tuple[TableRows, ...]
    tables: list[TableBlob]
    served_loss: ServedLoss | None
    #: each codec tried and refused first, with the loss it measured.
    reencoded: tuple[tuple[str, float], ...] = ()
    #: seconds spent updating the served copy and scoring it.
    measure_s: float = 0.0
    #: the release gate's word on the version before this one, judged on this snapshot's
    #: fresh samples (None: nothing judged).
    gate: GateWord | None = None

    @property
    def codec(self) -> str | None:
        """The codec of every table (None: no table)."""
        return self.rows[0].codec if self.rows else None


class ServedCodec:
    """The served-loss meter and `--codec auto`'s rule of one model's publisher."""

    def __init__(
        self,
        encode_table: TableEncoder,
        *,
        measure_served_loss: bool = False,
        codec_rule: ServedLossCodecRule | None = None,
        served_model: ServedModel | None = None,
        tunables: Tunables = DEFAULT_TUNABLES,
        gate: ReleaseGate | None = None,
    ) -> None:
        """`gate`: the release gate that judges each committed version on the next snapshot's
        fresh samples while the copy still holds it (publisher/release/gate.py); it needs the
        served loss measured (the copy)."""
        if gate is not None and not measure_served_loss:
            raise ValueError("a release gate scores the served-loss copy: measure the served loss")
        self.gate = gate
        self.encode_table = encode_table
        self.measure_served_loss = measure_served_loss
        self.codec_rule = codec_rule
        self.served_model = served_model
        self.tunables = tunables
        self._meter: ServedLossMeter | None = None

    @property
    def judges(self) -> bool:
        """Whether `choose` measures or chooses anything (else it only encodes)."""
        return self.measure_served_loss or self.codec_rule is not None

    def choose(
        self, snapshot: Snapshot, rows: Sequence[TableRows], largest: Mapping[str, float]
    ) -> CodecChoice:
        """Encode `rows` (the snapshot's, or a job's gathered on rank 0) with the codec the rule
        gives, measuring the served loss, and encode them again with more bits while it is over
        budget. `largest`: each table's largest magnitude (`Snapshot.check_finite`)."""
        chosen = tuple(rows)
        if self.codec_rule is not None:
            first = self.codec_rule.first_codec(snapshot.kind)
            chosen = tuple(replace(t, codec=first) for t in chosen)
        meter = self._meter_for(snapshot)
        gate = None
        if self.gate is not None and meter is not None:
            # Before the copy moves on: it still holds the last version committed, and the
            # snapshot's fresh samples came after it (publisher/release/gate.py).
            fresh = snapshot.scored[len(snapshot.scored) - snapshot.fresh :]
            outcome = self.gate.evaluate(meter, fresh)
            gate = None if outcome is None else GateWord.of(outcome)
        fp32_scores = None
        measure_s = 0.0
        if meter is not None:
            # The snapshot's rows, not what the blobs end up holding: a row a delta would leave
            # out as unchanged once encoded still moved in fp32 (publisher/served_loss.py).
            measuring = time.perf_counter()
            fp32_scores = meter.score_fp32(chosen, snapshot.dense, snapshot.scored)
            measure_s += time.perf_counter() - measuring
        tables, served_loss, seconds = self._encode(chosen, largest, meter, fp32_scores)
        measure_s += seconds
        reencoded: list[tuple[str, float]] = []
        while self.codec_rule is not None and served_loss is not None and chosen:
            # Over the budget at this codec: encode the same rows again with more bits before
            # anything is written. The samples scored look up only rows this version carries
            # (publisher/served_loss.py): at fp32 they score exactly as trained, so this ends.
            # Judged beyond the noise: a loss the window cannot tell from 0 adds no bits.
            sure = self.codec_rule.judged(served_loss)
            codec = self.codec_rule.step_up_now(sure, chosen[0].codec)
            if codec is None:
                break
            reencoded.append((chosen[0].codec, sure))
            log.info(
                "--codec auto: this version lost %.4f%% relative AUC served at %s (judged %s); "
                "encoding it again with %s",
                100 * sure,
                chosen[0].codec,
                self.codec_rule.judge,
                codec,
            )
            chosen = tuple(replace(t, codec=codec) for t in chosen)
            del tables  # the rejected blobs go before the new ones are encoded
            tables, served_loss, seconds = self._encode(chosen, largest, meter, fp32_scores)
            measure_s += seconds
        return CodecChoice(chosen, tables, served_loss, tuple(reencoded), measure_s, gate)

    def observe(self, ref: VersionRef, served_loss: ServedLoss | None) -> None:
        """A version committed with `served_loss`: the rule picks the next version's codec, and
        the gate judges it once the next snapshot brings the events after it."""
        version = ref.version
        if self.gate is not None and self._meter is not None and self._meter.complete:
            self.gate.committed(ref)
        if self.codec_rule is None:
            return
        before = self.codec_rule.codec
        after = self.codec_rule.observe(
            None if served_loss is None else self.codec_rule.judged(served_loss)
        )
        if after != before:
            log.info(
                "--codec auto: version %d lost %.4f%% relative AUC served; next codec %s",
                version,
                100 * served_loss.auc_rel_loss if served_loss is not None else float("nan"),
                after,
            )

    def _encode(
        self,
        rows: tuple[TableRows, ...],
        largest: Mapping[str, float],
        meter: ServedLossMeter | None,
        fp32_scores: Fp32Scores | None,
    ) -> tuple[list[TableBlob], ServedLoss | None, float]:
        """Every table's blob, the version's served loss (None: not measured) and the seconds
        spent measuring it. `fp32_scores` is the meter's first step for this snapshot; the
        decoded rows go to the meter table by table (one table's decoded rows at a time)."""
        tables = []
        measure_s = 0.0
        for t in rows:
            # check_finite refused NaN and inf and measured each table's magnitude
            q = encode_rows(t.codec, t.values, checked_finite=True, max_abs=largest[t.name])
            tables.append(self.encode_table(t, self.tunables, q))
            if meter is not None:
                measuring = time.perf_counter()
                meter.apply_table(t.name, t.row_ids, decode_rows(q), whole=t.whole)
                measure_s += time.perf_counter() - measuring
            del q
        served_loss = None
        if meter is not None:
            measuring = time.perf_counter()
            served_loss = meter.measure(fp32_scores)
            measure_s += time.perf_counter() - measuring
        return tables, served_loss, measure_s

    def _meter_for(self, snapshot: Snapshot) -> ServedLossMeter | None:
        """The served-loss copy of the snapshot's model; None when not measuring."""
        if not self.measure_served_loss:
            return None
        if self._meter is None or self._meter.model_config != snapshot.model_config:
            if self.served_model is not None:
                self._meter = self.served_model.meter(snapshot.model_config)
                return self._meter
            self._meter = ServedLossMeter.for_config(snapshot.model_config)
            if self._meter is None:
                # Not a model this module can rebuild: said once, not at every version.
                log.warning(
                    "served loss not measured: model_config %s is no DLRM's, and the "
                    "publisher has no served_model (IncrementalCheckpointer: give score=...)",
                    snapshot.model_config,
                )
                self.measure_served_loss = False
        return self._meter
