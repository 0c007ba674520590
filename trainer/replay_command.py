"""The `replay` command's registration (the `checknrun.commands` entry point
`replay = "trainer.replay_command:register"`): its options, and the sender loaded only when it
runs, so `checknrun --help` and `checknrun replay --help` import neither torch nor the streams."""

from __future__ import annotations

import argparse

from trainer.replay_options import add_replay_parser


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `replay` command (the `checknrun.commands` entry point)."""
    add_replay_parser(subparsers).set_defaults(func=_cmd_replay)


def _cmd_replay(args: argparse.Namespace) -> int:
    """Run `replay` (the sender, and torch with the streams, load only now)."""
    from trainer.replay import cmd_replay

    return cmd_replay(args)
