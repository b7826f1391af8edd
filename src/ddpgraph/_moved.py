"""Module paths that moved, kept importable for one release.

Each old path is a shim that re-exports the new module's names and calls `moved` once,
when it is first imported, so that the warning names the path to import from instead.
"""

from __future__ import annotations

import warnings


def moved(old: str, new: str) -> None:
    warnings.warn(
        f"`{old}` moved to `{new}`: import from `{new}`; the old path is removed in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
