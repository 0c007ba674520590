"""The test tiers, the markers that place each test in one, and the shared-services fixtures.

A test's markers say what it needs; a tier is a selection by markers. Every test is in exactly
one tier, so the four together are the whole suite (`bash scripts/test.sh`, CI):

    tier         what it holds                                             needs
    quick        in-process tests: no marker below                         nothing
    slow         `slow` or `multiprocess` (spawned ranks, a CLI process,   nothing
                 the publisher's child process: `publish_in="process"`)
    integration  `integration`: the shared Kafka broker and MinIO server   scripts/services.sh
    system       `faults`, `compose`, `e2e`: own services, Docker, whole   their own
                 programs run end to end

`pytest --tier quick` (or `bash scripts/test.sh --tier quick`) runs one; `-m` still narrows it.
The directory-wide markers are applied here, so a test in tests/integration is marked
`integration` without a decorator; a test elsewhere that needs the services carries the marker
itself (a contract suite's S3 and Kafka parameters do).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from minio import Minio

from tests.services import Services, services_from_environment

HERE = Path(__file__).resolve().parent

#: the markers every test under a directory of tests/ carries.
DIRECTORY_MARKERS: dict[str, tuple[str, ...]] = {
    "integration": ("integration",),
    "faults": ("integration", "faults"),
    "e2e": ("e2e",),
    "multiprocess": ("multiprocess",),
}

#: each tier's marker expression (pytest -m syntax); together they select every test once.
TIERS: dict[str, str] = {
    "quick": "not (slow or multiprocess or integration or faults or compose or e2e)",
    "slow": "(slow or multiprocess) and not (integration or faults or compose or e2e)",
    "integration": "integration and not (faults or compose or e2e)",
    "system": "faults or compose or e2e",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tier",
        choices=sorted(TIERS),
        default=None,
        help="run one tier of the suite (tests/conftest.py says what each holds)",
    )


def pytest_configure(config: pytest.Config) -> None:
    tier = config.getoption("--tier")
    if tier is not None:
        given = config.option.markexpr
        tier_expr = f"({TIERS[tier]})"
        config.option.markexpr = f"{tier_expr} and ({given})" if given else tier_expr


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            top = item.path.relative_to(HERE).parts[0]
        except ValueError:  # a test outside tests/
            continue
        for name in DIRECTORY_MARKERS.get(top, ()):
            item.add_marker(name)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("publish_in") == "process":
            item.add_marker("multiprocess")  # the publisher runs in a child process


@pytest.fixture(scope="session")
def services() -> Services:
    """The Kafka broker and MinIO server to test against (tests/services.py says which)."""
    return services_from_environment()


@pytest.fixture
def unique_name() -> str:
    """A fresh name valid both as a Kafka topic and as an S3 bucket (lowercase, 15 chars)."""
    return f"it-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def minio_client(services: Services) -> Iterator[Minio]:
    """A MinIO client logged in to the test object store."""
    client = Minio(
        services.s3_endpoint,
        access_key=services.s3_access_key,
        secret_key=services.s3_secret_key,
        secure=services.s3_secure,
        region=services.s3_region,
    )
    yield client
