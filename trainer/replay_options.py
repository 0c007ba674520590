"""Every `checknrun replay` option (trainer/replay.py sends the events).

Apart from the sender so that `checknrun --help` and `checknrun replay --help` import neither
torch nor the streams: trainer/replay_command.py registers the command with these options, and
`python -m trainer.replay` parses them too.
"""

from __future__ import annotations

import argparse

from publisher.cli import positive_int
from trainer.options import add_source_args


def add_replay_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the `replay` command's parser, with its options, to `subparsers`; its handler is the
    caller's to set."""
    p = subparsers.add_parser(
        "replay",
        help="replay a data set or file as live events on a Kafka topic",
        description="`checknrun replay`: any training source as a live event stream on a Kafka "
        "topic.",
    )
    p.add_argument("--data", default="movielens", help="movielens, synthetic, or a data file")
    p.add_argument("--to", required=True, help="kafka://HOST:PORT/TOPIC[?partitions=N]")
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--rate", type=float, default=None, help="at most N events per second")
    pace.add_argument(
        "--speedup", type=float, default=None, help="event time runs X times faster than now"
    )
    p.add_argument("--start", type=int, default=0, help="first sample to send (default 0)")
    p.add_argument("--max-events", type=positive_int, default=None, help="send at most N")
    p.add_argument("--seed", type=int, default=0, help="of the synthetic stream")
    p.add_argument(
        "--poison",
        action="append",
        default=[],
        metavar="KIND:...:START:STOP",
        help="break samples [START, STOP) on purpose, to see the release gate hold what trains "
        "on them: labels:START:STOP flips labels, ids:FEATURE:START:STOP scrambles a feature's "
        "ids, dense:NAME*FACTOR:START:STOP scales a numeric field (repeatable; docs/RELEASE.md)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document at the end")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_source_args(p)
    return p
