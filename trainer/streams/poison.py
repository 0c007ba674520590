"""A stream broken upstream on purpose, for a stretch: what the release gate must keep from the
fleet (docs/RELEASE.md). `checknrun replay --poison ...` sends it; `checknrun bench gate` trains
on it.

    labels:START:STOP            every label in samples [START, STOP) flipped (1 - label)
    ids:FEATURE:START:STOP       the feature's ids scrambled there: each id replaced by another
                                 of the feature's ids, one fixed random permutation (a join
                                 gone wrong upstream: the events name the wrong items)
    dense:NAME*FACTOR:START:STOP a numeric input scaled there (a unit changed upstream): one of
                                 the data's numeric columns (what replay sends as the events'
                                 dense field), or of the model's derived dense inputs (file
                                 training)

The stream is copied where it is poisoned (its other arrays are shared), so the original stays
as it was; the permutation is seeded, so a poisoned replay is the same every time.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from trainer.streams.base import ColumnarStream, DataError, IdColumn

PoisonKind = Literal["labels", "ids", "dense"]
_PATTERN = re.compile(
    r"^(?P<kind>labels|ids|dense)"
    r"(?::(?P<what>[A-Za-z_][A-Za-z0-9_]*)(?:\*(?P<factor>[0-9.eE+-]+))?)?"
    r":(?P<start>\d+):(?P<stop>\d+)$"
)


@dataclass(frozen=True)
class Poison:
    """One stretch of the stream broken in one way (see the module docstring)."""

    kind: PoisonKind
    start: int
    stop: int
    #: the feature (ids) or numeric column (dense) broken; None for labels.
    target: str | None = None
    #: dense: the factor the values are multiplied by.
    factor: float = 1.0
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> Poison:
        """`labels:S:E`, `ids:FEATURE:S:E` or `dense:NAME*FACTOR:S:E`; ValueError otherwise."""
        match = _PATTERN.match(text)
        if match is None:
            raise ValueError(
                f"poison {text!r}: expected labels:START:STOP, ids:FEATURE:START:STOP or "
                "dense:NAME*FACTOR:START:STOP"
            )
        kind, what, factor = match["kind"], match["what"], match["factor"]
        start, stop = int(match["start"]), int(match["stop"])
        if not start < stop:
            raise ValueError(f"poison {text!r}: START must be below STOP")
        if (kind == "labels") != (what is None) or (kind == "dense") != (factor is not None):
            raise ValueError(
                f"poison {text!r}: labels names no feature, ids a feature, dense NAME*FACTOR"
            )
        poison_kind: PoisonKind = (
            "labels" if kind == "labels" else "ids" if kind == "ids" else "dense"
        )
        return cls(poison_kind, start, stop, what, 1.0 if factor is None else float(factor))

    def overlaps(self, lo: int, hi: int) -> bool:
        """Whether samples [lo, hi) hold a poisoned one."""
        return lo < self.stop and self.start < hi


def poisoned(stream: ColumnarStream, poisons: Sequence[Poison]) -> ColumnarStream:
    """A copy of `stream` with each poison applied (DataError for a feature or column it does
    not have)."""
    out = stream
    for p in poisons:
        sl = slice(p.start, min(p.stop, stream.num_samples))
        if p.kind == "labels":
            labels = out.labels.copy()
            labels[sl] = 1.0 - labels[sl]
            out = out.replaced(labels=labels)
        elif p.kind == "ids":
            out = out.replaced(columns={str(p.target): _scrambled(out, p, sl)})
        else:
            out = _scaled(out, str(p.target), sl, p.factor)
    return out


def _scrambled(stream: ColumnarStream, p: Poison, sl: slice) -> IdColumn:
    names = [f.name for f in stream.features]
    if p.target not in names:
        raise DataError(f"poison: no feature {p.target!r} (features: {names})")
    column = stream.column(str(p.target))
    if column.splits is not None:
        raise DataError(f"poison: {p.target!r} is a bag; scramble a single-valued feature")
    values = column.values.copy()
    permutation = np.random.default_rng(p.seed).permutation(int(values.max(initial=0)) + 1)
    values[sl] = permutation[values[sl]]
    return replace(column, values=values)


def _scaled(stream: ColumnarStream, name: str, sl: slice, factor: float) -> ColumnarStream:
    if name in stream.numbers:
        values = np.array(stream.numbers[name], dtype=np.float64)
        values[sl] *= factor
        return stream.replaced(numbers={name: values})
    if name in stream.dense_names:
        dense = stream.dense.copy()
        dense[sl, stream.dense_names.index(name)] *= factor
        return stream.replaced(dense=dense)
    raise DataError(
        f"poison: no numeric column {name!r} (the data's: {sorted(stream.numbers)}; the "
        f"model's inputs: {list(stream.dense_names)})"
    )
