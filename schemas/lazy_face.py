"""A package's public face whose names load on first use (PEP 562 module `__getattr__`).

    __getattr__ = lazy_face(__name__, {"IncrementalCheckpointer": "trainer.checkpointer"})

`from trainer import IncrementalCheckpointer` imports trainer/checkpointer.py then, and only
then: importing a light module of the package (`trainer.options` for `checknrun train --help`)
does not import torch through the package's `__init__`. Type checkers read the same names from
the package's `if TYPE_CHECKING:` imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_face(package: str, exports: Mapping[str, str]) -> Callable[[str], object]:
    """The `__getattr__` of `package`: each name of `exports` from its module (name -> module)."""

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
