"""A user's model factory, `model_config -> nn.Module`, and calling one.

The serving side builds the served copies with it (publisher/read/copy_builders.py) and the
publisher its served-loss copy (publisher/served_loss.py). Its argument is a manifest's
`model_config` (hostile input, as all of a manifest) and its weights need not be drawn: a full
version writes every table row, and every version the dense state, before it is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

from torch import nn

from schemas.errors import BadDataError

#: builds the module a manifest's `model_config` describes.
ModelFactory: TypeAlias = Callable[[Mapping[str, Any]], nn.Module]


class ModelFactoryError(BadDataError):
    """A model factory refused a `model_config` (it raised) or returned no module."""


def build_module(factory: ModelFactory, model_config: Mapping[str, Any]) -> nn.Module:
    """`factory(model_config)`, checked to be a module; ModelFactoryError (from what it raised)
    otherwise: the factory's refusal of a config it cannot build says what is wrong."""
    try:
        module = factory(model_config)
    except Exception as exc:  # the user's code
        raise ModelFactoryError(
            f"the model factory cannot build model_config {dict(model_config)}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(module, nn.Module):
        raise ModelFactoryError(
            f"the model factory returned a {type(module).__name__}, not an nn.Module"
        )
    return module
