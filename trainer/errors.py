"""The trainer's own errors (the publisher's and the streams' have their own)."""

from __future__ import annotations

from schemas.errors import BadDataError


class CheckpointError(BadDataError):
    """The checkpointer was misused or a checkpoint does not fit the model it is loaded into."""
