"""`checknrun bench`: every measurement behind the README's figures, each part runnable alone.

    checknrun bench [--quick] [--json OUT]                       # the README's five parts
    checknrun bench PART [PART OPTIONS] [--quick] [--json OUT]   # one part
    checknrun bench PART --help                                  # the part's options
    checknrun bench report [--dir docs/benchmarks]   # RESULTS.md + PNGs from the part JSONs

A part is the module bench.PART: `run(quick, **options) -> dict` returns its JSON document and,
when the part takes options, `add_arguments(parser)` declares them under the names of run's
keyword arguments (an option left unset is None where its default depends on `--quick`).
`--quick` runs small sizes: the machinery, not the figures. Parts are imported only when run:
they pull in torch, matplotlib, the server and the S3 client, which other commands do without.

Progress goes to stderr, tables to stdout, the document to `--json OUT`. The freshness and
transport parts use real Kafka + MinIO when CHECKNRUN_KAFKA_BOOTSTRAP and CHECKNRUN_S3_ENDPOINT
are set (source ~/.cache/checknrun/services/env); freshness falls back to a file store and a
file bus. Registered through the `checknrun.commands` entry point `bench = "bench.cli:register"`;
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
from publisher.cli import CommandError, CommandParser, parse_command_line, run_command
from publisher.cli_logging import quiet_library_loggers

#: every part and what it measures.
PARTS = {
    "paper": "bytes per interval and storage of every policy x codec (the paper's figures)",
    "accuracy": "AUC of the served model and of restores from quantized checkpoints; bit rule",
    "stall": "training stall and overhead per checkpoint, next to torch.save and DCP async_save",
    "codec": "encode/decode throughput and error of every codec",
    "freshness": "train step -> served latency, apply time, predict latency (serving parts)",
    "restore": "restore of a baseline + chain, one worker and one per core, next to torch.load",
    "transport": "S3 upload throughput and announcement latency (needs Kafka + MinIO)",
    "serving": "the serving side in detail: apply, pause, http, freshness",
    "rejections": "time and memory a reader spends refusing each hostile store object",
    "idmap": "stall, bytes and rebuild time an open id space's id map adds to checkpoints",
    "rawids": "raw-id predictions and id-map applies, next to the same model of encoded ids",
    "live": "training from a Kafka event stream next to the file trainer (needs Kafka)",
    "idspace": "MovieLens through Kafka: dynamic vs hashed id spaces, a new id's freshness",
    "admission": "cold start's calibration, a flood of one-off ids, memory of ids without a row",
    "dense": "the events' numeric fields as model inputs (--dense-features) next to ids only",
    "livejob": "a live topic trained by a sharded job of N ranks (hashed, dynamic ids) next to "
    "one process (Kafka)",
    "servedloss": "what measuring each version's served loss costs training, and what it says",
    "shards": "a job of N ranks publishing row-range shards next to one writer; their restore",
    "shardckpt": "a sharded job's stall per rank and publish time per version, 1 vs 2 ranks",
    "endpoint": "one answer over /v1, v2 REST and v2 gRPC (tritonclient) next to the model's "
    "forward and a naive FastAPI endpoint",
    "usermodel": "a user model served by --model-factory next to the DLRM of the same tables: "
    "apply, predict p50/p99",
    "framework": "Ray Serve kept live by a Subscriber: predict p50/p99 idle and while applying",
    "gate": "the release gate: false holds on clean streams, poisoned streams held (Kafka), "
    "its cost",
}
#: what `checknrun bench` without a part runs: the parts the README's figures come from.
DEFAULT_PARTS = ("paper", "accuracy", "stall", "codec", "freshness")


def add_run_options(parser: argparse.ArgumentParser, *, inherited: bool = False) -> None:
    """`--quick` and `--json OUT`, which `bench` and every part take.

    A part's subcommands take them too, `inherited`: unset unless given there, so that values
    given before the subcommand stand.
    """
    unset: dict[str, Any] = {"default": argparse.SUPPRESS} if inherited else {}
    parser.add_argument(
        "--quick", action="store_true", help="small sizes: checks the machinery", **unset
    )
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT", **unset)


def run_part(part: str, quick: bool, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one part with its `options` (default: all of them defaults)."""
    module = importlib.import_module(f"bench.{part}")
    started = time.perf_counter()
    doc: dict[str, Any] = module.run(quick, **(options or {}))
    doc["seconds"] = round(time.perf_counter() - started, 1)
    log(f"{part}: done in {doc['seconds']} s")
    return doc


def part_parser(prog: str, part: str) -> argparse.ArgumentParser:
    """The parser of `checknrun bench PART`'s own options (a usage error there is reported by
    `run_command` like any other, exit status 2)."""
    if part == "report":
        parser = CommandParser(prog=f"{prog} report", description="RESULTS.md + plots")
        parser.add_argument(
            "--dir", default="docs/benchmarks", help="where the part JSONs are, and the output"
        )
        return parser
    parser = CommandParser(prog=f"{prog} {part}", description=PARTS[part])
    add_run_options(parser)
    add_arguments = getattr(importlib.import_module(f"bench.{part}"), "add_arguments", None)
    if add_arguments is not None:
        add_arguments(parser)
    return parser


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the named part (or the default ones) and write the JSON document."""
    quiet_library_loggers()  # the serving parts send thousands of requests through httpx
    if args.part is None:
        doc: dict[str, Any] = {
            "bench": "all",
            "quick": args.quick,
            "machine": describe_machine(),
            "parts": {p: run_part(p, args.quick) for p in DEFAULT_PARTS},
        }
        out = args.json
    elif args.part == "report":
        if args.quick or args.json:
            raise CommandError("report takes only --dir")
        from bench.report import write

        directory = part_parser(args.bench_prog, "report").parse_args(args.options).dir
        log(f"wrote {write(Path(directory))}")
        return 0
    else:
        parser = part_parser(args.bench_prog, args.part)
        parser.set_defaults(quick=args.quick, json=args.json)  # given before PART
        options = vars(parser.parse_args(args.options))
        quick, out = options.pop("quick"), options.pop("json")
        doc = run_part(args.part, quick, options)
    write_json(doc, out)
    if out:
        log(f"wrote {out}")
    return 0


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The `bench` options: the part, and what follows it goes to the part's own parser."""
    parts = "\n".join(f"  {name:<10} {what}" for name, what in PARTS.items())
    p.epilog = f"parts:\n{parts}\n  report     RESULTS.md and the plots from the part JSONs"
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_run_options(p)
    p.add_argument(
        "part",
        nargs="?",
        choices=[*PARTS, "report"],
        metavar="PART",
        help=f"one part (default: {', '.join(DEFAULT_PARTS)})",
    )
    p.add_argument("options", nargs=argparse.REMAINDER, help="the part's options (see PART --help)")
    p.set_defaults(bench_prog=p.prog)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `bench` command (the `checknrun.commands` entry point)."""
    p = subparsers.add_parser(
        "bench",
        help="benchmarks: bytes, accuracy, stall, codecs, freshness, restore, transport, serving",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_bench_args(p)
    p.set_defaults(func=cmd_bench)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.cli [PART [PART OPTIONS]] [--quick] [--json OUT]`."""
    parser = CommandParser(prog="python -m bench.cli", description=__doc__)
    add_bench_args(parser)
    parser.set_defaults(command="bench", func=cmd_bench)
    return run_command(parse_command_line(parser, argv))


if __name__ == "__main__":
    sys.exit(main())
