"""The package root and `ddpgraph.bench` load their public names on first use
(`ddpgraph.exports`): each name of `__all__` is the object of the module the package's
`if TYPE_CHECKING:` imports name, and importing the packages alone imports no torch,
which the `ddpgraph` command's launching process relies on.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from types import ModuleType

import pytest

import ddpgraph
import ddpgraph.bench

PACKAGES = [ddpgraph, ddpgraph.bench]


def type_checking_imports(package: ModuleType) -> dict[str, str]:
    """name -> module (relative) of the imports under the package's `if TYPE_CHECKING:`."""
    tree = ast.parse(inspect.getsource(package))
    block = next(
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    )
    return {
        alias.asname or alias.name: "." * node.level + (node.module or "")
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_every_public_name_is_the_object_of_its_module(package: ModuleType) -> None:
    imports = type_checking_imports(package)
    assert sorted(set(package.__all__) - {"__version__"}) == sorted(imports)
    for name, module in imports.items():
        defining = importlib.import_module(module, package.__name__)
        assert getattr(package, name) is getattr(defining, name), name
        assert name in vars(package), f"{name} is not kept after its first use"
    assert dir(package) == package.__all__


def test_the_roots_public_names_are_as_published() -> None:
    assert ddpgraph.__all__ == sorted(ddpgraph.__all__) and len(ddpgraph.__all__) == 27
    assert {"capture_step", "make_step", "prepare_ddp", "__version__"} <= set(ddpgraph.__all__)
    assert isinstance(ddpgraph.__version__, str)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_an_unknown_name_is_an_attribute_error(package: ModuleType) -> None:
    with pytest.raises(
        AttributeError, match=f"module '{package.__name__}' has no attribute 'nope'"
    ):
        package.nope  # noqa: B018
    assert not hasattr(package, "nope")


def test_importing_the_packages_imports_no_torch() -> None:
    code = (
        "import sys, ddpgraph, ddpgraph.bench, ddpgraph.app.cli\n"
        "print(sorted(m for m in ('torch', 'numpy', 'matplotlib') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
