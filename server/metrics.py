"""Prometheus text exposition (format 0.0.4), hand-written: counters, gauges and histograms.

A few dozen lines do what the server needs without a client library: every instrument keeps its
values under one lock and renders itself; histograms keep cumulative bucket counts so a scrape is
O(buckets). Label values are escaped as the format requires. `ServerMetrics` names every
instrument the server exports in one place, so /metrics and the docs cannot drift apart.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from publisher.read import SubscriberObserver, UpdateResult, VersionRef
from publisher.read.follower import FollowerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: latency buckets (seconds) from 100 µs to 30 s, roughly x2.5 apart.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

LabelValues = tuple[str, ...]
_I = TypeVar("_I", bound="_Instrument")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Instrument:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.label_names = tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: Sequence[str]) -> LabelValues:
        if len(labels) != len(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {tuple(labels)}")
        return tuple(str(v) for v in labels)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class Counter(_Instrument):
    """A value that only goes up (per label set)."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[LabelValues, float] = {} if labels else {(): 0.0}

    def inc(self, amount: float = 1.0, labels: Sequence[str] = ()) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: counters only go up, got {amount}")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, labels: Sequence[str] = ()) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def total(self) -> float:
        with self._lock:
            return sum(self._values.values())

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        lines = self.header()
        lines += [f"{self.name}{_labels(self.label_names, k)} {_format_value(v)}" for k, v in items]
        return lines


class Gauge(_Instrument):
    """A value that goes up and down; either set, or read from a callback at scrape time."""

    kind = "gauge"

    def __init__(
        self, name: str, help_text: str, read: Callable[[], float | None] | None = None
    ) -> None:
        super().__init__(name, help_text)
        self._value: float = 0.0
        self._read = read

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)

    def value(self) -> float | None:
        if self._read is not None:
            return self._read()
        with self._lock:
            return self._value

    def render(self) -> list[str]:
        value = self.value()
        if value is None:  # nothing to report yet (e.g. no version served): omit the sample
            return self.header()
        return [*self.header(), f"{self.name} {_format_value(value)}"]


class Histogram(_Instrument):
    """Observations counted into cumulative buckets (`le`), plus their sum and count."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        help_text: str,
        buckets: Iterable[float] = LATENCY_BUCKETS,
        labels: Sequence[str] = (),
    ) -> None:
        super().__init__(name, help_text, labels)
        self.buckets = tuple(sorted(float(b) for b in buckets))
        if not self.buckets or any(math.isinf(b) for b in self.buckets):
            raise ValueError(f"{self.name}: give finite buckets; +Inf is implicit")
        self._series: dict[LabelValues, tuple[list[int], list[float]]] = {}

    def observe(self, value: float, labels: Sequence[str] = ()) -> None:
        key = self._key(labels)
        with self._lock:
            counts, totals = self._series.setdefault(key, ([0] * (len(self.buckets) + 1), [0.0]))
            # Cumulative buckets: an observation counts in every bucket whose bound it fits.
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    counts[i] += 1
            counts[-1] += 1
            totals[0] += value

    def count(self, labels: Sequence[str] = ()) -> int:
        with self._lock:
            series = self._series.get(self._key(labels))
            return 0 if series is None else series[0][-1]

    def render(self) -> list[str]:
        with self._lock:
            items = sorted((k, (list(c), t[0])) for k, (c, t) in self._series.items())
        lines = self.header()
        for key, (counts, total) in items:
            for bound, n in zip((*self.buckets, math.inf), counts, strict=True):
                le = f'le="{_format_value(bound)}"'
                lines.append(f"{self.name}_bucket{_labels(self.label_names, key, le)} {n}")
            lines.append(f"{self.name}_sum{_labels(self.label_names, key)} {_format_value(total)}")
            lines.append(f"{self.name}_count{_labels(self.label_names, key)} {counts[-1]}")
        return lines


class Registry:
    """Instruments in registration order; `render()` is the /metrics body."""

    def __init__(self) -> None:
        self._instruments: list[_Instrument] = []

    def register(self, instrument: _Instrument) -> None:
        if any(i.name == instrument.name for i in self._instruments):
            raise ValueError(f"metric {instrument.name} registered twice")
        self._instruments.append(instrument)

    def render(self) -> str:
        lines: list[str] = []
        for instrument in self._instruments:
            lines += instrument.render()
        return "\n".join(lines) + "\n"


class ServerMetrics:
    """Every metric the server exports (names prefixed `checknrun_server_`)."""

    def __init__(self) -> None:
        self.registry = Registry()
        p = "checknrun_server_"
        self.applied_versions = self._add(
            Counter(f"{p}versions_applied_total", "Versions applied to the live model.", ["kind"])
        )
        self.apply_seconds = self._add(
            Histogram(
                f"{p}apply_seconds",
                "Seconds to fetch, verify, decode and swap in one plan of versions.",
                labels=["kind"],
            )
        )
        self.swap_pause_seconds = self._add(
            Histogram(
                f"{p}swap_pause_seconds",
                "Seconds predictions could not start while a version was swapped in.",
            )
        )
        self.bytes_fetched = self._add(
            Counter(f"{p}bytes_fetched_total", "Blob bytes fetched from the store and verified.")
        )
        self.rejected = self._add(
            Counter(
                f"{p}rejected_versions_total",
                "Versions rejected (failed verification, decoding or layout checks), by reason.",
                ["reason"],
            )
        )
        self.follow_errors = self._add(
            Counter(
                f"{p}follow_errors_total", "Follow-loop failures other than rejections.", ["kind"]
            )
        )
        self.follower_events = self._add(
            Counter(
                f"{p}follower_events_total",
                "Announcement follower counters, by reason.",
                ["reason"],
            )
        )
        self.predict_seconds = self._add(
            Histogram(f"{p}predict_seconds", "Seconds per predict request (validation + model).")
        )
        self.predict_examples = self._add(Counter(f"{p}predict_examples_total", "Examples scored."))
        self.raw_ids = self._add(
            Counter(
                f"{p}raw_ids_total",
                "Raw ids mapped in predict requests (models trained from raw events), by feature.",
                ["feature"],
            )
        )
        self.unknown_ids = self._add(
            Counter(
                f"{p}unknown_ids_total",
                "Raw ids the served version did not know (served by row 0), by feature.",
                ["feature"],
            )
        )
        self.requests = self._add(
            Counter(
                f"{p}http_requests_total",
                "HTTP requests by route, method and status.",
                ["route", "method", "status"],
            )
        )
        self.version = self._add(Gauge(f"{p}model_version", "Version being served."))
        self.staleness = self._add(
            Gauge(
                f"{p}staleness_seconds",
                "Seconds the oldest known unapplied committed version has waited (0 = current).",
            )
        )
        self.age = self._add(
            Gauge(f"{p}model_age_seconds", "Seconds since the served version was created.")
        )
        self.pinned = self._add(Gauge(f"{p}pinned", "1 while an admin pin holds the version."))
        self.ready = self._add(Gauge(f"{p}ready", "1 once bootstrapped and fresh enough."))
        self.model_bytes = self._add(
            Gauge(f"{p}model_memory_bytes", "Bytes of model weights held (every buffer).")
        )

    def _add(self, instrument: _I) -> _I:
        self.registry.register(instrument)
        return instrument

    def bind(
        self,
        *,
        version: Callable[[], float | None],
        staleness: Callable[[], float | None],
        age: Callable[[], float | None],
        pinned: Callable[[], float | None],
        ready: Callable[[], float | None],
        model_bytes: Callable[[], float | None],
    ) -> None:
        """Read the gauges that describe the live model from it at scrape time."""
        self.version._read = version
        self.staleness._read = staleness
        self.age._read = age
        self.pinned._read = pinned
        self.ready._read = ready
        self.model_bytes._read = model_bytes

    def render(self) -> str:
        return self.registry.render()


class MetricsObserver(SubscriberObserver):
    """The subscriber's events as the server's metrics."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def applied(
        self, plan: Sequence[VersionRef], result: UpdateResult, seconds: float, kind: str
    ) -> None:
        for ref in plan:
            self.metrics.applied_versions.inc(labels=[ref.manifest.kind])
        self.metrics.apply_seconds.observe(seconds, labels=[kind])
        self.metrics.swap_pause_seconds.observe(result.pause_s)

    def fetched(self, nbytes: int) -> None:
        self.metrics.bytes_fetched.inc(nbytes)

    def rejected(self, reason: str) -> None:
        self.metrics.rejected.inc(labels=[reason])

    def failed(self, kind: str) -> None:
        self.metrics.follow_errors.inc(labels=[kind])

    def follower_stats(self, stats: FollowerStats) -> None:
        counts = {f"ignored_{k}": v for k, v in stats.ignored.items()}
        counts.update(
            received=stats.received,
            reconciles=stats.reconciles,
            coalesced=stats.coalesced,
            head_polls=stats.head_polls,
            store_errors=stats.store_errors,
        )
        events = self.metrics.follower_events
        for reason, value in counts.items():
            seen = events.value(labels=[reason])
            if value > seen:
                events.inc(value - seen, labels=[reason])
