"""How the checknrun commands log: our own lines at the chosen level, the libraries' quieter.

At INFO, httpx logs one line per request (`HTTP Request: POST ...`: 95 of the 113 lines
`scripts/demo.sh` printed), kafka-python one per connection and metadata refresh, uvicorn one
per request served. Those libraries are held at WARNING unless the root logger is at DEBUG
(`checknrun -v`, `serve --log-level debug`): then they follow it, and show everything.
"""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: loggers of libraries that log per request, per poll or per connection at INFO.
LIBRARY_LOGGERS = ("httpx", "httpcore", "uvicorn.access", "kafka", "urllib3")


def configure_logging(level: int | str = logging.INFO, *, fmt: str = LOG_FORMAT) -> None:
    """Log to stderr at `level` (the root logger; see `logging.basicConfig`, which does nothing
    when the root logger already has a handler), the library loggers quieter
    (`quiet_library_loggers`)."""
    logging.basicConfig(level=level, format=fmt, stream=sys.stderr)
    quiet_library_loggers()


def quiet_library_loggers() -> None:
    """Hold LIBRARY_LOGGERS at WARNING while the root logger is above DEBUG; at DEBUG give
    them back to it (NOTSET). Call again after changing the root logger's level."""
    verbose = logging.getLogger().getEffectiveLevel() <= logging.DEBUG
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)
