"""The commands' logging: the libraries that log per request (httpx, kafka, uvicorn's access log)
are held at WARNING at the default level, our own INFO lines still show, and at DEBUG (`-v`,
`serve --log-level debug`) the libraries' lines come back."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from publisher.cli_logging import LIBRARY_LOGGERS, configure_logging, quiet_library_loggers


@pytest.fixture(autouse=True)
def _levels_restored() -> Iterator[None]:
    names = ["", *LIBRARY_LOGGERS]
    kept = {name: logging.getLogger(name).level for name in names}
    yield
    for name, level in kept.items():
        logging.getLogger(name).setLevel(level)


def configure_as_a_command_does(level: int = logging.INFO) -> None:
    """`configure_logging` on a root logger without handlers, as in a fresh process (pytest's
    own handlers are put back after; the one it added goes)."""
    root = logging.getLogger()
    kept = root.handlers[:]
    root.handlers.clear()
    try:
        configure_logging(level)
        assert len(root.handlers) == 1
    finally:
        root.handlers[:] = kept


def test_libraries_are_quiet_at_the_default_level_and_ours_are_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    configure_as_a_command_does()
    assert {name: logging.getLogger(name).level for name in LIBRARY_LOGGERS} == dict.fromkeys(
        LIBRARY_LOGGERS, logging.WARNING
    )
    assert logging.getLogger("trainer.resume").getEffectiveLevel() == logging.INFO
    caplog.set_level(logging.INFO)  # the capture handler's level, not the loggers'
    caplog.clear()
    logging.getLogger("httpx").info('HTTP Request: POST http://x/v1/predict "HTTP/1.1 200 OK"')
    logging.getLogger("kafka.conn").info("connecting to broker")
    logging.getLogger("trainer.resume").info("resumed from v3 at sample 4,096")
    logging.getLogger("httpx").warning("a library's warning still shows")
    assert [r.getMessage() for r in caplog.records] == [
        "resumed from v3 at sample 4,096",
        "a library's warning still shows",
    ]


def test_debug_gives_the_libraries_lines_back() -> None:
    configure_as_a_command_does(logging.DEBUG)
    for name in LIBRARY_LOGGERS:
        assert logging.getLogger(name).level == logging.NOTSET, name
        assert logging.getLogger(name).getEffectiveLevel() == logging.DEBUG, name
    # `serve --log-level warning` after that: the root level changes, the libraries follow it
    # once quieted again.
    logging.getLogger().setLevel(logging.WARNING)
    quiet_library_loggers()
    assert logging.getLogger("httpx").level == logging.WARNING
