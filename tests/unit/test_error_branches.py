"""Every error class checknrun raises sits under one root, in the branch its name promises: the
CLIs' exit statuses and the server's reject-or-retry decision read nothing else."""

from __future__ import annotations

import pickle

import pytest

from publisher.bus import BusError
from publisher.cli import EXIT_ERROR, EXIT_UNAVAILABLE, CommandError, exit_status
from publisher.codecs import CodecError, NonFiniteRowsError, OutOfRangeRowsError
from publisher.dlrm import ArchitectureError
from publisher.read.catalog import CatalogError, NoVersionError
from publisher.read.errors import ApplyError, NotBootstrappedError, PinnedError, ShuttingDownError
from publisher.read.restore import RestoreError
from publisher.store import (
    BadKeyError,
    IntegrityError,
    NotFoundError,
    PreconditionFailedError,
    StoreError,
    StoreUnavailableError,
)
from publisher.write.policies import PolicyError
from publisher.write.process_publisher import (
    PublisherBadDataError,
    PublisherConflictError,
    PublisherProcessError,
    PublisherUnavailableError,
    _picklable,
)
from publisher.write.tracker import RowIdError, TrackerError
from publisher.write.version_writer import HeadConflictError, LeaseHeldError, WriterError
from schemas.errors import (
    BadDataError,
    CheckNRunError,
    ConflictError,
    FormatError,
    ManifestError,
    UnavailableError,
)
from schemas.tensor_blob import TensorBlobError
from server.feature_problems import FeatureValidationError
from trainer.checkpointer import CheckpointError
from trainer.streams.base import DataError

BRANCHES = (BadDataError, UnavailableError, ConflictError)

#: each class and the one branch it belongs to (None: directly under the root).
EXPECTED: list[tuple[type[CheckNRunError], type[CheckNRunError] | None]] = [
    (FormatError, BadDataError),
    (ManifestError, BadDataError),
    (TensorBlobError, BadDataError),
    (CodecError, BadDataError),
    (NonFiniteRowsError, BadDataError),
    (ArchitectureError, BadDataError),
    (CatalogError, BadDataError),
    (NoVersionError, BadDataError),
    (RestoreError, BadDataError),
    (BusError, BadDataError),
    (PolicyError, BadDataError),
    (TrackerError, BadDataError),
    (RowIdError, BadDataError),
    (CommandError, BadDataError),
    (CheckpointError, BadDataError),
    (DataError, BadDataError),
    (ApplyError, BadDataError),
    (FeatureValidationError, BadDataError),
    (NotFoundError, BadDataError),
    (IntegrityError, BadDataError),
    (BadKeyError, BadDataError),
    (StoreUnavailableError, UnavailableError),
    (NotBootstrappedError, UnavailableError),
    (ShuttingDownError, UnavailableError),
    (PreconditionFailedError, ConflictError),
    (LeaseHeldError, ConflictError),
    (HeadConflictError, ConflictError),
    (PinnedError, ConflictError),
    (StoreError, None),  # a refused or misconfigured store: neither the data nor an outage
    (WriterError, None),
    (PublisherProcessError, None),
    (PublisherBadDataError, BadDataError),
    (PublisherUnavailableError, UnavailableError),
    (PublisherConflictError, ConflictError),
]


@pytest.mark.parametrize(("cls", "branch"), EXPECTED, ids=lambda v: getattr(v, "__name__", "-"))
def test_each_error_is_in_exactly_its_branch(
    cls: type[CheckNRunError], branch: type[CheckNRunError] | None
) -> None:
    assert issubclass(cls, CheckNRunError)
    assert [b for b in BRANCHES if issubclass(cls, b)] == ([] if branch is None else [branch])


def test_a_held_lease_is_not_a_store_error() -> None:
    assert not issubclass(LeaseHeldError, StoreError)
    assert not issubclass(HeadConflictError, StoreError)


def test_bad_data_keeps_its_builtin_base() -> None:
    # pydantic validators and callers of the codecs catch ValueError: keep giving them one.
    for cls in (FormatError, CodecError, PolicyError, DataError, ArchitectureError):
        assert issubclass(cls, ValueError), cls


@pytest.mark.parametrize("cls", [LeaseHeldError, StoreUnavailableError, IntegrityError])
def test_errors_survive_pickling(cls: type[CheckNRunError]) -> None:
    # The process publisher hands its child's errors to the parent by pickle.
    again = pickle.loads(pickle.dumps(cls("why")))
    assert type(again) is cls and str(again) == "why"


def test_codec_errors_survive_pickling() -> None:
    for exc in (NonFiniteRowsError(3), OutOfRangeRowsError(4, "int4", "|x| >= 65504")):
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is type(exc) and str(again) == str(exc) and again.row == exc.row


class _TwoFields(StoreUnavailableError):
    """An error whose constructor takes other arguments than its message: unpickling fails."""

    def __init__(self, host: str, why: str) -> None:
        super().__init__(f"{host}: {why}")


class _TwoFieldsBug(LookupError):
    def __init__(self, host: str, why: str) -> None:
        super().__init__(f"{host}: {why}")


def test_an_error_that_cannot_cross_the_pipe_keeps_its_branch() -> None:
    # The process publisher sends `_picklable(exc)`: the stand-in keeps the branch, so the exit
    # status (and the publisher's retry of UnavailableError) is thread mode's.
    sent = _picklable(_TwoFields("minio:9000", "connection refused"))
    assert isinstance(sent, PublisherUnavailableError) and exit_status(sent) == EXIT_UNAVAILABLE
    assert str(sent) == "_TwoFields: minio:9000: connection refused"
    assert type(pickle.loads(pickle.dumps(sent))) is PublisherUnavailableError
    sent = _picklable(WriterError("a message only"))  # crosses as itself
    assert type(sent) is WriterError and exit_status(sent) == EXIT_ERROR
    # A bug is no checknrun error: it stays one (a traceback), as in thread mode.
    bug = _picklable(_TwoFieldsBug("h", "why"))
    assert type(bug) is RuntimeError and not isinstance(bug, CheckNRunError)
