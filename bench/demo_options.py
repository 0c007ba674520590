"""Every `checknrun demo` option (bench/demo.py runs the demo).

Apart from the demo so that `checknrun --help` and `checknrun demo --help` import neither torch
nor the trainer: bench/demo_command.py registers the command with these options, and
`python -m bench.demo` parses them too.
"""

from __future__ import annotations

import argparse


def add_demo_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the `demo` command's parser, with its options, to `subparsers`; its handler is the
    caller's to set."""
    p = subparsers.add_parser(
        "demo",
        help="train on MovieLens-1M and serve the live model, side by side (embedded default)",
    )
    p.add_argument(
        "--dir",
        default="checknrun-demo",
        help="working directory for the store, the announcement log and the server log "
        "(emptied first; default %(default)s)",
    )
    p.add_argument(
        "--max-samples",
        type=int,
        default=300_000,
        help="samples to train on (default %(default)s; 1000209 = the whole stream)",
    )
    p.add_argument("--interval-samples", type=int, default=25_000, help="a version every N samples")
    p.add_argument(
        "--rate",
        type=float,
        default=10_000,
        help="samples arriving per second (default %(default)s; 0 = as fast as possible)",
    )
    p.add_argument("--policy", default="intermittent")
    p.add_argument("--codec", default="int4")
    p.add_argument(
        "--eval-samples",
        type=int,
        default=4096,
        help="upcoming samples both sides score after each version (default %(default)s)",
    )
    return p
