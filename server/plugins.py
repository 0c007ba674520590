"""`MODULE:FUNCTION` references to a user's code: `checknrun serve --model-factory` and
`--request-adapter`, resolved the way uvicorn resolves `app:main`.

The current directory goes on `sys.path` first (as uvicorn's default `--app-dir`), so a module
beside where `serve` runs imports without being installed. `MODULE` is a dotted module path,
`FUNCTION` a dotted attribute path inside it; what it names must be callable. Every failure
(no colon, a module that does not import, a missing or non-callable attribute) is one
`PluginError` naming the reference, raised when `serve` starts, before anything is served.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from schemas.errors import BadDataError


class PluginError(BadDataError, ValueError):
    """A `MODULE:FUNCTION` reference that does not name a callable."""


def load_callable(reference: str, what: str) -> Callable[..., Any]:
    """The callable `reference` (`MODULE:FUNCTION`) names; `what` says what it is for."""
    module_name, sep, attr_path = reference.partition(":")
    if not sep or not module_name or not attr_path:
        raise PluginError(f"{what} {reference!r}: expected MODULE:FUNCTION (e.g. mymodels:build)")
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module's own failure at import
        raise PluginError(
            f"{what} {reference!r}: module {module_name!r} does not import "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise PluginError(f"{what} {reference!r}: {module_name} has no {attr_path}") from exc
    if not callable(target):
        raise PluginError(f"{what} {reference!r}: {attr_path} is not callable")
    return target  # type: ignore[no-any-return]
