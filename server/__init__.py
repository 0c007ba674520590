"""The serving side: a REST inference server keeping a live copy of any model.

    checknrun serve --store s3://bucket/prefix --bus kafka://host:9092/versions --model movielens
    checknrun serve ... --model-factory mymodels:build --request-adapter mymodels:requests

`create_app(settings)` builds the FastAPI application; its lifespan opens the store and the
announcement source and runs a `publisher.read.Subscriber` (bootstrap from HEAD, then follow) in
a background thread, applying versions to a `ModuleSink` of the built-in DLRM or of a model of
your own. The server stands on the publisher's read side and on `schemas/`; nothing imports it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServerSettings", "create_app", "load_settings"]


def __getattr__(name: str) -> Any:
    # Lazily: every `checknrun` command imports `server.cli` to register `serve`, and only
    # `serve` needs FastAPI and the model.
    if name == "create_app":
        from server.app import create_app

        return create_app
    if name in ("ServerSettings", "load_settings"):
        from server import settings

        return getattr(settings, name)
    raise AttributeError(f"module 'server' has no attribute {name!r}")
