"""Module paths that moved, kept importable for one release.

Each old path is a shim that re-exports the new module's names and calls `moved` once,
when it is first imported, so that the warning names the path to import from instead.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from typing import Any


def moved(old: str, new: str, *, stacklevel: int = 3) -> None:
    warnings.warn(
        f"`{old}` moved to `{new}`: import from `{new}`; the old path is removed in the next release",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


class _ShadowedPath(types.ModuleType):
    """An old module path whose name the package root also gives to an object it
    re-exports (`ddpgraph.accumulate`, the function). Importing a module file there would
    make the package attribute that module; registered in `sys.modules` up front, the
    path imports without touching the package, and warns when a name is read from it."""

    def __init__(self, old: str, new: str) -> None:
        super().__init__(old, f"Deprecated path of `{new}`.")
        self._new = new

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name != "__all__":
            raise AttributeError(name)
        value = getattr(importlib.import_module(self._new), name)  # a missing name: no warning
        moved(self.__name__, self._new)
        return value


def alias_shadowed(old: str, new: str) -> None:
    sys.modules.setdefault(old, _ShadowedPath(old, new))
