"""What can go wrong between the store and a version a subscriber serves: the read side's own
errors (a version's bytes failing verification raise the store's and the schemas' errors)."""

from __future__ import annotations

from schemas.errors import BadDataError, CheckNRunError, ConflictError, UnavailableError


class SubscriberError(CheckNRunError):
    """Base of the read side's own failures."""


class NotBootstrappedError(SubscriberError, UnavailableError):
    """No version is served yet (the bootstrap has not finished)."""


class ApplyError(SubscriberError, BadDataError):
    """A version that cannot be applied to the sink: it disagrees with the model it is applied
    to, or the sink's model factory cannot build it.

    Raised with what the version says and what the sink holds, e.g. a delta for a table the
    model does not have, or dense parameters of another shape.
    """


class NonFiniteError(ApplyError):
    """A version whose decoded rows or dense tensors hold NaN or Inf: every prediction touching
    them would score NaN, so it is rejected like any other bad version."""


class ShuttingDownError(SubscriberError, UnavailableError):
    """The subscriber is stopping: an apply in progress was abandoned before its next version."""


class PinnedError(SubscriberError, ConflictError):
    """The subscriber is pinned: following is suspended until it is unpinned."""
