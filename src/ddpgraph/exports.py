"""A package's public names loaded on first use (PEP 562): each name is imported from the
module that defines it when it is first read, and kept in the package's namespace, so
the next read is a plain look-up.

The package root and `bench` load their names this way: importing the package alone,
as the `ddpgraph` command's launching process does, then imports no PyTorch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping


def load_export(package: str, exports: Mapping[str, str], name: str) -> object:
    """`package`'s public `name`, imported from its module (`exports` maps each name to
    its module, relative to the package) and kept in the package's namespace; an
    AttributeError, as for any module, for a name it does not export."""
    module = exports.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, package), name)
    setattr(sys.modules[package], name, value)
    return value
