"""`checknrun bench`: every measurement behind the README's figures, or one part of it.

    checknrun bench --quick [--json OUT]          # every part, small sizes (CI: the machinery)
    checknrun bench PART [--quick] [--json OUT]   # PART: paper, accuracy, stall, codec, freshness
    checknrun bench report [--dir docs/benchmarks]  # RESULTS.md + PNGs from the part JSONs

Progress goes to stderr. The freshness part uses real Kafka + MinIO when
CHECKNRUN_KAFKA_BOOTSTRAP and CHECKNRUN_S3_ENDPOINT are set, else a file store and a file bus.
Registered through the `checknrun.commands` entry point `bench = "bench.cli:register"`;
`python -m bench.cli ...` runs it without the entry point.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.machine import describe_machine, log, write_json

PARTS = ("paper", "accuracy", "stall", "codec", "freshness")


def run_part(part: str, quick: bool) -> dict[str, Any]:
    """Run one part (imported lazily: parts pull in torch, matplotlib, the server...)."""
    module = importlib.import_module(f"bench.{part}")
    started = time.perf_counter()
    doc: dict[str, Any] = module.run(quick)
    doc["seconds"] = round(time.perf_counter() - started, 1)
    log(f"{part}: done in {doc['seconds']} s")
    return doc


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the named part (or all of them) and write the JSON document."""
    if args.part == "report":
        from bench.report import write

        log(f"wrote {write(Path(args.dir))}")
        return 0
    if args.part is None:
        parts = {p: run_part(p, args.quick) for p in PARTS}
        doc: dict[str, Any] = {
            "bench": "all",
            "quick": args.quick,
            "machine": describe_machine(),
            "parts": parts,
        }
    else:
        doc = run_part(args.part, args.quick)
    write_json(doc, args.json)
    if args.json:
        log(f"wrote {args.json}")
    return 0


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The `bench` options."""
    p.add_argument(
        "part",
        nargs="?",
        choices=[*PARTS, "report"],
        help="one part (default: all of them); `report` rebuilds RESULTS.md and the plots",
    )
    p.add_argument("--quick", action="store_true", help="small sizes: checks the machinery")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    p.add_argument(
        "--dir", default="docs/benchmarks", help="report: where the part JSONs are (and output)"
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `bench` command (the `checknrun.commands` entry point)."""
    p = subparsers.add_parser(
        "bench",
        help="benchmarks: bytes, accuracy, stall, codecs, freshness",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_bench_args(p)
    p.set_defaults(func=cmd_bench)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.cli [PART] [--quick] [--json OUT]`."""
    parser = argparse.ArgumentParser(prog="python -m bench.cli", description=__doc__)
    add_bench_args(parser)
    args = parser.parse_args(argv)
    return cmd_bench(args)


if __name__ == "__main__":
    sys.exit(main())
