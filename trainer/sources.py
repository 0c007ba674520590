"""The stream `--data` names: a built-in data set, a data file, or a live event topic."""

from __future__ import annotations

import argparse
import difflib
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from publisher.cli import CommandError
from trainer.live_options import open_live_stream
from trainer.options import DATA_SETS, is_live
from trainer.streams.base import InteractionStream

if TYPE_CHECKING:
    from trainer.streams.tabular import ColumnMapping


def open_stream(
    args: argparse.Namespace, stop_event: threading.Event | None = None
) -> InteractionStream:
    """The stream `--data` names (DataError on a bad file or mapping, CommandError on a name
    that is neither a data set nor a file); a live stream ends its batches on `stop_event`."""
    if is_live(args.data):
        return open_live_stream(args, stop_event or threading.Event())
    if args.data == "movielens":
        from trainer.streams.movielens import load_movielens

        return load_movielens()
    if args.data == "synthetic":
        from trainer.streams.synthetic import (
            SyntheticConfig,
            SyntheticStream,
            criteo_like_cardinalities,
        )

        return SyntheticStream(
            SyntheticConfig(
                cardinalities=criteo_like_cardinalities(args.table_cap),
                seed=args.seed,
                zipf_exponent=args.zipf,
                drift=args.drift,
                label_bias=args.label_bias,
            )
        )
    from trainer.streams.tabular import CSV_SUFFIXES, PARQUET_SUFFIXES, load_table

    if not Path(args.data).suffix and not Path(args.data).exists():  # a mistyped data set name
        close = difflib.get_close_matches(args.data, DATA_SETS, n=1)
        raise CommandError(
            f"--data {args.data!r} is neither a data set ({', '.join(DATA_SETS)}) nor a file"
            + (f": did you mean {close[0]!r}?" if close else "")
            + f" (a file is a {', '.join(CSV_SUFFIXES + PARQUET_SUFFIXES)} log)"
        )

    return load_table(args.data, column_mapping(args))


def column_mapping(args: argparse.Namespace) -> ColumnMapping:
    """The `ColumnMapping` the data file column options (`add_file_args`) describe."""
    from trainer.streams.tabular import ColumnMapping

    return ColumnMapping(
        user=args.user_col,
        item=args.item_col,
        timestamp=args.time_col or None,
        label=args.label_col,
        rating=args.rating_col,
        rating_threshold=args.rating_threshold,
        categorical=tuple(args.categorical_cols),
        bags=tuple(args.bag_cols),
        bag_separator=args.bag_sep,
        dense=tuple(args.dense_cols),
    )
