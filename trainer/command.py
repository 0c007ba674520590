"""The `train` command's registration (the `checknrun.commands` entry point
`train = "trainer.command:register"`): its options, and the driver loaded only when it runs, so
`checknrun --help` and `checknrun train --help` import neither torch nor the trainer."""

from __future__ import annotations

import argparse

from trainer.options import add_train_args


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `train` command (the `checknrun.commands` entry point)."""
    p = subparsers.add_parser(
        "train",
        help="train online on a stream and publish incremental checkpoints",
        description="Online training that publishes incremental checkpoints as it goes.",
    )
    add_train_args(p)
    p.set_defaults(func=_cmd_train)


def _cmd_train(args: argparse.Namespace) -> int:
    """Run `train` (the drivers, and torch with them, load only now)."""
    from trainer.cli import cmd_train

    return cmd_train(args)
