"""`GET /status`: the release gate's page for a person; `GET /status.json`: the same data.

The history is read from the store (HEAD's chain, the release records, the versions'
evaluations: a few dozen small reads), at most once per `HISTORY_TTL_S` per process however
often the page is asked for, on a worker thread; a store that cannot be read is a 503 naming
why. Each request process opens the store read-only on first use (`--workers`: every process
can answer).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Final

from fastapi import APIRouter, HTTPException, status
from fastapi.responses import HTMLResponse, JSONResponse

from publisher.release.log import ReleaseLog
from publisher.release.status import ReleaseHistory, release_history
from publisher.store import open_store
from schemas.errors import CheckNRunError
from server.dependencies import StateDep
from server.status_page import render

router = APIRouter(tags=["status"])

#: seconds a read history is reused: the page costs the store a few reads per this, not per view.
HISTORY_TTL_S: Final = 2.0
#: versions the page shows.
SHOWN_VERSIONS: Final = 60


class _HistoryCache:
    """One process' history of the model, read at most once per `HISTORY_TTL_S`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._log: ReleaseLog | None = None
        self._read_at = float("-inf")
        self._history: ReleaseHistory | None = None

    def get(self, store_url: str, model: str) -> ReleaseHistory:
        with self._lock:
            now = time.monotonic()
            if self._history is not None and now - self._read_at < HISTORY_TTL_S:
                return self._history
            if self._log is None:
                self._log = ReleaseLog(open_store(store_url, create=False), model)
            self._history = release_history(self._log, SHOWN_VERSIONS)
            self._read_at = now
            return self._history


_CACHE = _HistoryCache()


def _facts(state: StateDep) -> tuple[ReleaseHistory, dict[str, Any]]:
    settings = state.settings
    try:
        history = _CACHE.get(settings.store, settings.model)
    except (CheckNRunError, OSError) as exc:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, f"store: {type(exc).__name__}: {exc}"
        ) from exc
    live = state.live
    version = None if live is None else live.version
    times = None if live is None else live.last_times
    server = {
        "track": settings.track,
        "version": version,
        "staleness_s": None if live is None or version is None else live.staleness_s(),
        "age_s": None if live is None else live.age_s(),
        "last_applied_at": None if times is None else times.served_at,
        "process": state.process,
    }
    return history, server


@router.get(
    "/status",
    summary="For a person: what this server serves, and what the release gate did with each "
    "version and why",
    response_class=HTMLResponse,
)
def status_page(state: StateDep) -> HTMLResponse:
    history, server = _facts(state)
    return HTMLResponse(render(history, server))


@router.get("/status.json", summary="The status page's data")
def status_json(state: StateDep) -> JSONResponse:
    history, server = _facts(state)
    return JSONResponse({"server": server, **history.to_json()})
