"""The server's error hierarchy (what can go wrong between the store and a served version), and
how text a client sent appears in an error response."""

from __future__ import annotations

from schemas.errors import BadDataError, CheckNRunError, ConflictError, UnavailableError

#: characters of one client-supplied string shown in an error response.
SHOWN_INPUT_CHARS = 64


def shown_input(text: str, limit: int = SHOWN_INPUT_CHARS) -> str:
    """`text` from a request as an error response may show it: at most `limit` characters, and
    encodable as UTF-8 (a lone surrogate, which JSON escapes can carry, becomes the literal text
    `\\ud800`; left as it is, rendering the response raised and the client got a 500)."""
    cut = text if len(text) <= limit else text[:limit] + "..."
    return cut.encode("utf-8", "backslashreplace").decode("utf-8")


class ServerError(CheckNRunError):
    """Base of the serving side's own failures."""


class NotBootstrappedError(ServerError, UnavailableError):
    """No version is served yet (the bootstrap has not finished)."""


class ApplyError(ServerError, BadDataError):
    """A version that cannot be applied to the live model: it disagrees with its layout.

    Raised with what the version says and what the live model holds, e.g. a delta for a table the
    model does not have, or dense parameters of another shape.
    """


class NonFiniteError(ApplyError):
    """A version whose decoded rows or dense tensors hold NaN or Inf: every prediction touching
    them would score NaN, so it is rejected like any other bad version."""


class ShuttingDownError(ServerError, UnavailableError):
    """The server is stopping: an apply in progress was abandoned before its next version."""


class PinnedError(ServerError, ConflictError):
    """The live model is pinned: following is suspended until an admin unpins it."""
