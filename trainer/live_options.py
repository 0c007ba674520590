"""The live event stream the `train` options describe (`--data kafka://HOST:PORT/TOPIC`).

    checknrun train --data kafka://localhost:9092/events --features user,item,genres[] \\
        --dense-features price,dwell_s,affinity:raw --id-space dynamic \\
        --id-capacity 100000,user=200000 --admit-after 2 --evict-after-s 604800 \\
        --store file://./store --model live

`--features` names the events' id fields (a trailing `[]` marks a bag); by default the
MovieLens set that `checknrun replay --data movielens` produces. `--dense-features` names the
events' numeric fields (docs/FORMAT.md section 8.4: each a transformed value and a missing
flag). `--id-capacity` is the rows of every table, or `N,name=M,...` (N for the tables not
named); in a dynamic id space one row of each table is the unknown row, so a table holds
capacity - 1 ids. The options themselves are trainer/options.py's (`add_live_args`).
"""

from __future__ import annotations

import argparse
import threading
from dataclasses import replace

from publisher.cli import CommandError
from publisher.live_features import LiveSpec, LiveSpecError
from trainer.id_space import IdSpacePolicy
from trainer.options import DEFAULT_COUNT_FEATURES, DEFAULT_ID_CAPACITY
from trainer.streams.kafka_events import KafkaEventStream
from trainer.streams.kafka_reader import EventSource


def live_spec(args: argparse.Namespace) -> LiveSpec:
    """The feature spec the options describe; CommandError when they describe none."""
    try:
        features = LiveSpec.parse_features(args.features)
        singles = {f.name for f in features if not f.bag}
        wanted = [n.strip() for n in args.count_features.split(",") if n.strip()]
        defaults = args.count_features == ",".join(DEFAULT_COUNT_FEATURES)
        counts = tuple(n for n in wanted if n in singles) if defaults else tuple(wanted)
        return LiveSpec(
            features=features,
            id_space=args.id_space,
            count_features=counts,
            rating_threshold=args.rating_threshold,
            dense_features=LiveSpec.parse_dense_features(args.dense_features),
        )
    except LiveSpecError as exc:
        raise CommandError(f"--features / --count-features / --dense-features: {exc}") from exc


def table_rows(spec: LiveSpec, text: str) -> dict[str, int]:
    """`--id-capacity`: N for every table, or N,name=M,... ; CommandError otherwise."""
    default: int | None = None
    named: dict[str, int] = {}
    try:
        for part in (p.strip() for p in text.split(",") if p.strip()):
            name, eq, value = part.rpartition("=")
            if eq:
                named[name.strip()] = int(value)
            else:
                default = int(value)
    except ValueError as exc:
        raise CommandError(f"--id-capacity {text!r}: expected N or N,name=M,...") from exc
    unknown = sorted(set(named) - set(spec.names))
    if unknown:
        raise CommandError(f"--id-capacity names {unknown}, which are not --features")
    rows = {name: named.get(name, default or DEFAULT_ID_CAPACITY) for name in spec.names}
    least = 1 if spec.id_space == "hash" else 2
    small = {n: r for n, r in rows.items() if not least <= r <= 2**31}
    if small:
        raise CommandError(f"--id-capacity: every table needs {least} .. 2**31 rows, got {small}")
    return rows


def open_live_stream(
    args: argparse.Namespace,
    stop_event: threading.Event,
    partitions: tuple[int, ...] | None = None,
) -> KafkaEventStream:
    """The event stream `--data kafka://...` and the live options describe; `partitions`: the
    ones to read instead of the URL's (one rank's part of a sharded job)."""
    spec = live_spec(args)
    if args.evict_after_s is not None and not args.evict_after_s > 0:
        raise CommandError(f"--evict-after-s must be > 0, got {args.evict_after_s}")
    if args.from_topic_start and not getattr(args, "resume", False):
        raise CommandError("--from-topic-start goes with --resume (on a recreated topic)")
    if not args.max_batch_wait_ms >= 0:
        raise CommandError(f"--max-batch-wait-ms must be >= 0, got {args.max_batch_wait_ms}")
    if not args.max_event_lead_s >= 0:
        raise CommandError(f"--max-event-lead-s must be >= 0, got {args.max_event_lead_s}")
    source = EventSource.parse(args.data)
    return KafkaEventStream(
        source if partitions is None else replace(source, partitions=partitions),
        spec,
        table_rows(spec, args.id_capacity),
        IdSpacePolicy(
            admit_after=args.admit_after,
            evict_after_s=args.evict_after_s,
            max_event_lead_s=args.max_event_lead_s,
            cold_start=args.cold_start == "unknown-row",
        ),
        stop_event=stop_event,
        stop_at_end=args.stop_at_end,
        from_topic_start=args.from_topic_start,
        max_batch_wait_s=args.max_batch_wait_ms / 1000.0,
    )
