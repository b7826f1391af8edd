"""The layout shows the architecture, and stays that way.

The capture core is the flat modules of `src/ddpgraph` and its concept packages; the
packages around it (`training`, `strategies`, `integrations`, `app`, `bench`, `doctor`) are
built on it, so the core never
imports them: a core module that did would load, and depend on, the layers above it.
Exempt is the API layer above both: the package root, which re-exports the public names,
`capture.py`, the `capture_step` facade (which builds the compile strategy's step for
`compile=True`), and `__main__`. Imports under `if TYPE_CHECKING:` are annotations only
and run nothing, so they are not dependencies at run time.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "ddpgraph"
README = SRC.parents[1] / "README.md"
ABOVE_THE_CORE = (
    "ddpgraph.training",
    "ddpgraph.strategies",
    "ddpgraph.integrations",
    "ddpgraph.app",
    "ddpgraph.bench",
    "ddpgraph.doctor",
)
LAYERS = {name.split(".")[1] for name in ABOVE_THE_CORE}
# The API layer: above the core and the strategies, so exempt.
API_LAYER = ("__init__.py", "__main__.py", "capture.py")
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 300


def _resolve(level: int, name: str | None, package: tuple[str, ...] = ("ddpgraph",)) -> str:
    """The absolute module a relative import in a module of `package` names."""
    if level == 0:
        return name or ""
    base = list(package[: max(0, len(package) - (level - 1))])
    return ".".join([*base, *([name] if name else [])])


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers inside `if TYPE_CHECKING:` blocks."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_above_core(source: str, package: tuple[str, ...] = ("ddpgraph",)) -> list[tuple[int, str]]:
    """(line, module) of every run-time import in a flat core module of the packages
    above the core: `import`, `from ... import` (at any depth, relative or absolute,
    including `from . import strategies`) and `importlib.import_module("...")`."""
    tree = ast.parse(source)
    skip = _type_checking_only(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.level, node.module, package)
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            targets = [node.args[0].value]
        hits = sorted({t for t in targets if any(t == p or t.startswith(p + ".") for p in ABOVE_THE_CORE)})
        if hits and node.lineno not in skip:
            found.append((node.lineno, hits[0]))
    return found


def _core_modules() -> list[Path]:
    return [
        p
        for p in sorted(SRC.rglob("*.py"))
        if p.relative_to(SRC).parts[0] not in LAYERS and p.relative_to(SRC).parts[0] not in API_LAYER
    ]


def _package(path: Path) -> tuple[str, ...]:
    return ("ddpgraph", *path.relative_to(SRC).parent.parts)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from .strategies.base import TrainStep\n", ["ddpgraph.strategies.base"]),
        ("from . import strategies\n", ["ddpgraph.strategies"]),
        ("def f():\n    from .training.scaler import GraphSafeGradScaler\n", ["ddpgraph.training.scaler"]),
        ("import ddpgraph.app.cli\n", ["ddpgraph.app.cli"]),
        ("from ddpgraph.doctor import run\n", ["ddpgraph.doctor"]),
        ("import importlib\nimportlib.import_module('ddpgraph.bench.command')\n", ["ddpgraph.bench.command"]),
        ("from .streams import capture_stream\nfrom . import ddp\nimport ddpgraph.errors\n", []),
        ("from .trainings import x\nfrom .strategies_like import y\n", []),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .strategies.base import TrainStep\n", []),
    ],
)
def test_the_checker_finds_each_kind_of_import_above_the_core(source: str, expected: list[str]) -> None:
    assert [module for _, module in imports_above_core(source)] == expected


def test_the_capture_core_imports_nothing_above_it() -> None:
    core = _core_modules()
    assert len(core) > 30 and any(p.name == "engine.py" for p in core)  # the rule checks the real core
    offenders = [
        f"{p.relative_to(SRC)}:{line} imports {module}"
        for p in core
        for line, module in imports_above_core(p.read_text(), _package(p))
    ]
    assert offenders == [], "the capture core imports a layer built on it:\n" + "\n".join(offenders)


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _classes() -> list[tuple[str, str, int]]:
    out = []
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                out.append((str(p.relative_to(SRC)), node.name, (node.end_lineno or node.lineno) - node.lineno + 1))
    return out


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_is_over_400_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= MAX_MODULE_LINES


@pytest.mark.parametrize(("path", "name", "lines"), _classes(), ids=lambda v: str(v))
def test_no_class_is_over_300_lines(path: str, name: str, lines: int) -> None:
    assert lines <= MAX_CLASS_LINES, f"{path}: class {name} is {lines} lines"


def _architecture() -> str:
    text = README.read_text()
    section = text.split("\n## Architecture\n", 1)[1]
    return section.split("\n## ", 1)[0]


def test_readme_architecture_names_only_paths_that_exist_and_every_package() -> None:
    section = _architecture()
    named = set(re.findall(r"`([\w/]+(?:\.py|/))`", section))
    assert len(named) >= 10
    missing = sorted(n for n in named if not (SRC.parents[1] / n if n.startswith("src/") else SRC / n).exists())
    assert missing == [], f"README's architecture names paths that are not in src/ddpgraph: {missing}"
    packages = {f"{p.parent.relative_to(SRC)}/" for p in SRC.glob("*/__init__.py")}
    assert packages - named == set(), "README's architecture leaves out a package"
