"""The server's error hierarchy: what can go wrong between the store and a served version."""

from __future__ import annotations

from schemas.errors import BadDataError, CheckNRunError, ConflictError, UnavailableError


class ServerError(CheckNRunError):
    """Base of the serving side's own failures."""


class NotBootstrappedError(ServerError, UnavailableError):
    """No version is served yet (the bootstrap has not finished)."""


class ApplyError(ServerError, BadDataError):
    """A version that cannot be applied to the live model: it disagrees with its layout.

    Raised with what the version says and what the live model holds, e.g. a delta for a table the
    model does not have, or dense parameters of another shape.
    """


class ShuttingDownError(ServerError, UnavailableError):
    """The server is stopping: an apply in progress was abandoned before its next version."""


class PinnedError(ServerError, ConflictError):
    """The live model is pinned: following is suspended until an admin unpins it."""
