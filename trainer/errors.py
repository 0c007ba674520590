"""The trainer's own errors (the publisher's and the streams' have their own)."""

from __future__ import annotations

from schemas.errors import BadDataError, CheckNRunError


class CheckpointError(BadDataError):
    """The checkpointer was misused or a checkpoint does not fit the model it is loaded into."""


class RankFailedError(CheckNRunError):
    """A rank of a sharded job failed or died, so the job stopped; the message names the rank
    and its error (which may be of any branch: a bad file, an unreachable store, a bug)."""
