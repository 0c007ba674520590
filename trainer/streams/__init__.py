"""Interaction streams replayed in time order: MovieLens-1M, a synthetic Criteo-like stream, and
any CSV/Parquet log. Each yields `Batch`es from a resumable sample offset."""

from trainer.streams.base import Batch, DataError, InteractionStream

__all__ = ["Batch", "DataError", "InteractionStream"]
