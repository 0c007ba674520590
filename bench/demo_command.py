"""The `demo` command's registration (the `checknrun.commands` entry point
`demo = "bench.demo_command:register"`): its options, and the demo loaded only when it runs, so
`checknrun --help` and `checknrun demo --help` import neither torch nor the trainer."""

from __future__ import annotations

import argparse

from bench.demo_options import add_demo_parser


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `demo` to the `checknrun` command line (the `checknrun.commands` entry point)."""
    add_demo_parser(subparsers).set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo (torch and the trainer load only now)."""
    from bench.demo import cmd_demo

    return cmd_demo(args)
