"""What route handlers receive, as `Annotated` dependency aliases, and the admin guard.

The app's lifespan puts one `ServerState` on `app.state.server`; handlers ask for the piece they
need (`LiveModelDep`, `PredictorDep`, `SettingsDep`...), so their signatures read like types and
tests can swap settings by building another app.
"""

from __future__ import annotations

import hmac
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Annotated, Protocol

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from publisher.read import ModelCopy, ServedVersion, VersionSink
from publisher.read.live_model import ApplyTimes
from server.metrics import ServerMetrics
from server.predictors import Predictor
from server.settings import ServerSettings


class ServedModel(Protocol):
    """The live model as the routes read it: the subscriber's `LiveModel` in a one-process
    server (and the apply side of `--workers`), a `server.workers.mirror.MirrorLive` in a
    worker process."""

    @property
    def sink(self) -> VersionSink: ...
    @property
    def model_name(self) -> str: ...
    @property
    def version(self) -> int | None: ...
    @property
    def pinned(self) -> int | None: ...
    @property
    def versions_applied(self) -> int: ...
    @property
    def bytes_fetched(self) -> int: ...
    @property
    def last_times(self) -> ApplyTimes | None: ...
    def reader(self) -> AbstractContextManager[ModelCopy]: ...
    def staleness_s(self, now: float | None = None) -> float: ...
    def age_s(self, now: float | None = None) -> float | None: ...
    def latest_known(self) -> int | None: ...
    def nbytes(self) -> int: ...
    def pin(self, version: int) -> ServedVersion: ...
    def unpin(self) -> bool: ...
    def digest(self) -> tuple[int, dict[str, str]]: ...


class Follower(Protocol):
    """What moves the served model: the `Subscriber`, or a worker's `WorkerFollower`."""

    @property
    def live(self) -> ServedModel: ...
    @property
    def rejected(self) -> int: ...
    def request_catch_up(self) -> None: ...


@dataclass
class ServerState:
    """What the app holds: its settings, metrics and predictor, and the follower the lifespan
    created (None until the lifespan has run)."""

    settings: ServerSettings
    metrics: ServerMetrics
    predictor: Predictor
    subscriber: Follower | None = None
    #: the port the v2 gRPC server bound (`grpc_port`), None without one.
    grpc_port: int | None = None
    #: this request process' index (`--workers`: 0 applies the versions).
    process: int = 0

    @property
    def live(self) -> ServedModel | None:
        """The served model (the follower's), None until the lifespan has run."""
        return None if self.subscriber is None else self.subscriber.live


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


StateDep = Annotated[ServerState, Depends(get_state)]


def get_settings(state: StateDep) -> ServerSettings:
    return state.settings


def get_metrics(state: StateDep) -> ServerMetrics:
    return state.metrics


def get_predictor(state: StateDep) -> Predictor:
    return state.predictor


def get_live_model(state: StateDep) -> ServedModel:
    if state.live is None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "the server is starting")
    return state.live


SettingsDep = Annotated[ServerSettings, Depends(get_settings)]
MetricsDep = Annotated[ServerMetrics, Depends(get_metrics)]
LiveModelDep = Annotated[ServedModel, Depends(get_live_model)]
PredictorDep = Annotated[Predictor, Depends(get_predictor)]

_bearer = HTTPBearer(
    auto_error=False,
    description="Admin token (`CHECKNRUN_SERVER_ADMIN_TOKEN`). Without one configured the "
    "admin endpoints answer 404.",
)


def require_admin(
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """404 when no admin token is configured, 401 unless `Authorization: Bearer <token>`."""
    token = settings.admin_token
    if token is None:
        # Disabled endpoints look absent: nothing to probe, nothing to brute-force.
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            "admin endpoints are disabled: no admin token is configured",
        )
    expected = token.get_secret_value().encode()
    given = b"" if credentials is None else credentials.credentials.encode()
    # compare_digest takes time independent of where the strings differ.
    if credentials is None or not hmac.compare_digest(given, expected):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing or wrong admin token",
            headers={"WWW-Authenticate": "Bearer"},
        )


AdminDep = Annotated[None, Depends(require_admin)]
