"""A package's public face whose names load on first use (PEP 562 module `__getattr__`).

    __getattr__ = lazy_face(__name__, {"IncrementalCheckpointer": "trainer.checkpointer"})

`from trainer import IncrementalCheckpointer` imports trainer/checkpointer.py then, and only
then: importing a light module of the package (`trainer.options` for `checknrun train --help`)
does not import torch through the package's `__init__`. Type checkers read the same names from
the package's `if TYPE_CHECKING:` imports.

A face name may also be a submodule's (publisher.read's `restore`, the function of
publisher/read/restore.py). Python binds a submodule on its package when the submodule loads,
which would make every later `from publisher.read import restore` the module; a lazy face keeps
such a name its own, as an eager `from .restore import restore` in `__init__` did.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from types import ModuleType


def lazy_face(package: str, exports: Mapping[str, str]) -> Callable[[str], object]:
    """The `__getattr__` of `package`: each name of `exports` from its module (name -> module).

    Called from the package's `__init__`, it also makes the package keep the names of `exports`
    that its submodules share (see the module docstring).
    """

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    class LazyFace(ModuleType):
        """The package, whose face names win over the submodules named alike."""

        def __setattr__(self, name: str, value: object) -> None:
            submodule = isinstance(value, ModuleType) and value.__name__ == f"{package}.{name}"
            if submodule and name in exports:
                return  # the import system binding the submodule: the face's name stays
            super().__setattr__(name, value)

    sys.modules[package].__class__ = LazyFace
    return __getattr__
