"""The server's Prometheus metrics, on `prometheus_client`, all named in one place.

`ServerMetrics` declares every instrument the server exports (names prefixed
`checknrun_server_`), so /metrics and docs/SERVER.md cannot drift apart. Each instance owns its
`CollectorRegistry`: tests build many apps in one process, and the library's global default
registry would refuse the second app's names. `render()` is the /metrics body in text format
0.0.4; the gauges that describe the live model are read from it at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from publisher.read import SubscriberObserver, UpdateResult, VersionRef
from publisher.read.follower import FollowerStats

PREFIX = "checknrun_server_"
#: what `render()` writes (the library's CONTENT_TYPE_LATEST is now the 1.0.0 text format).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

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

#: the gauges read from the live model at scrape time: name (after the prefix) -> help.
MODEL_GAUGES: dict[str, str] = {
    "model_version": "Version being served.",
    "staleness_seconds": (
        "Seconds the oldest known unapplied committed version has waited (0 = current)."
    ),
    "model_age_seconds": "Seconds since the served version was created.",
    "pinned": "1 while an admin pin holds the version.",
    "ready": "1 once bootstrapped and fresh enough.",
    "model_memory_bytes": "Bytes of model weights held (every buffer).",
}

Read = Callable[[], float | None]


class _Registry(CollectorRegistry):
    """A registry without the library's `<counter>_created` series: in the 0.0.4 text format
    each would be one more gauge series per counter series, holding a start time nobody reads."""

    def collect(self) -> Iterator[Metric]:
        for family in super().collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class _ModelGauges:
    """A collector of the `MODEL_GAUGES`, each read at scrape time from its bound callback and
    labelled with the server's track; one with nothing to report (no version served yet) keeps
    its HELP and TYPE but has no sample."""

    def __init__(self, track: str) -> None:
        self.reads: dict[str, Read] = {}
        self.track = track

    def collect(self) -> Iterator[Metric]:
        for name, help_text in MODEL_GAUGES.items():
            family = GaugeMetricFamily(PREFIX + name, help_text, labels=["track"])
            read = self.reads.get(name)
            value = None if read is None else read()
            if value is not None:
                family.add_metric([self.track], value)
            yield family


class ServerMetrics:
    """Every metric the server exports, on a registry of its own. The served version's gauges
    and the predictions' series carry the server's `track` (released or candidate), so a fleet
    whose slice serves candidates is compared by track (docs/RELEASE.md)."""

    def __init__(self, track: str = "released") -> None:
        self.track = track
        self.registry: CollectorRegistry = _Registry()

        def counter(name: str, help_text: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(PREFIX + name, help_text, labels, registry=self.registry)

        def histogram(name: str, help_text: str, labels: Sequence[str] = ()) -> Histogram:
            return Histogram(
                PREFIX + name, help_text, labels, registry=self.registry, buckets=LATENCY_BUCKETS
            )

        self.applied_versions = counter(
            "versions_applied_total", "Versions applied to the live model.", ["kind"]
        )
        self.apply_seconds = histogram(
            "apply_seconds",
            "Seconds to fetch, verify, decode and swap in one plan of versions.",
            ["kind"],
        )
        self.swap_pause_seconds = histogram(
            "swap_pause_seconds",
            "Seconds predictions could not start while a version was swapped in.",
        )
        self.bytes_fetched = counter(
            "bytes_fetched_total", "Blob bytes fetched from the store and verified."
        )
        self.rejected = counter(
            "rejected_versions_total",
            "Versions rejected (failed verification, decoding or layout checks), by reason.",
            ["reason"],
        )
        self.follow_errors = counter(
            "follow_errors_total", "Follow-loop failures other than rejections.", ["kind"]
        )
        self.follower_events = counter(
            "follower_events_total", "Announcement follower counters, by reason.", ["reason"]
        )
        self.predict_seconds = histogram(
            "predict_seconds", "Seconds per predict request (validation + model).", ["track"]
        ).labels(track)
        self.predict_examples = counter(
            "predict_examples_total", "Examples scored.", ["track"]
        ).labels(track)
        self.raw_ids = counter(
            "raw_ids_total",
            "Raw ids mapped in predict requests (models trained from raw events), by feature.",
            ["feature"],
        )
        self.unknown_ids = counter(
            "unknown_ids_total",
            "Raw ids the served version did not know (served by row 0), by feature.",
            ["feature"],
        )
        self.requests = counter(
            "http_requests_total",
            "HTTP requests by route, method and status.",
            ["route", "method", "status"],
        )
        self._model_gauges = _ModelGauges(track)
        self.registry.register(self._model_gauges)

    def bind(
        self,
        *,
        version: Read,
        staleness: Read,
        age: Read,
        pinned: Read,
        ready: Read,
        model_bytes: Read,
    ) -> None:
        """Read the gauges that describe the live model from it at scrape time."""
        self._model_gauges.reads = {
            "model_version": version,
            "staleness_seconds": staleness,
            "model_age_seconds": age,
            "pinned": pinned,
            "ready": ready,
            "model_memory_bytes": model_bytes,
        }

    def render(self) -> bytes:
        """The /metrics body (served as `CONTENT_TYPE`)."""
        return generate_latest(self.registry)


def counted(counter: Counter, **labels: str) -> float:
    """What `counter` has counted over its series whose labels include `labels`: one series'
    value, or with no labels the counter's total."""
    return sum(
        sample.value
        for family in counter.collect()
        for sample in family.samples
        if sample.name.endswith("_total") and labels.items() <= sample.labels.items()
    )


class MetricsObserver(SubscriberObserver):
    """The subscriber's events as the server's metrics."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._follower_counts: dict[str, int] = {}  # the follower's totals counted so far

    def applied(
        self, plan: Sequence[VersionRef], result: UpdateResult, seconds: float, kind: str
    ) -> None:
        for ref in plan:
            self.metrics.applied_versions.labels(ref.manifest.kind).inc()
        self.metrics.apply_seconds.labels(kind).observe(seconds)
        self.metrics.swap_pause_seconds.observe(result.pause_s)

    def fetched(self, nbytes: int) -> None:
        self.metrics.bytes_fetched.inc(nbytes)

    def rejected(self, reason: str) -> None:
        self.metrics.rejected.labels(reason).inc()

    def failed(self, kind: str) -> None:
        self.metrics.follow_errors.labels(kind).inc()

    def follower_stats(self, stats: FollowerStats) -> None:
        # The follower keeps running totals; the counters take what was added since last time.
        totals = {f"ignored_{k}": v for k, v in stats.ignored.items()}
        totals.update(
            received=stats.received,
            reconciles=stats.reconciles,
            coalesced=stats.coalesced,
            head_polls=stats.head_polls,
            store_errors=stats.store_errors,
        )
        for reason, total in totals.items():
            seen = self._follower_counts.get(reason, 0)
            if total > seen:
                self.metrics.follower_events.labels(reason).inc(total - seen)
                self._follower_counts[reason] = total
