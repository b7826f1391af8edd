"""The layout shows the architecture, and rules that measure the design keep it so.

Each rule has a test of its checker on small snippets (so that it can fail) and a test on
the real tree (the checkers live in `design_rules.py`):

* The layer rule. The capture core is the root modules of `src/ddpgraph` and its concept
  packages; the packages around it (`training`, `strategies`, `integrations`, `app`,
  `bench`, `doctor`) are built on it, so the core never imports them, at any depth: a
  core module that did would load, and depend on, the layers above it. Exempt are the
  API layer above the core and the strategies (the package root, `__main__` and
  `capture.py`) and alias modules, whose only work is re-exporting a moved module's names.
* No import cycles among ddpgraph's modules. Every run-time import counts, at module
  level or inside a function: a function-level import that closes a cycle only hides it.
  Imports under `if TYPE_CHECKING:` are annotations only and run nothing, so they don't.
* No module reaches into another's private names. `x._name` (not a dunder), where `x` is
  not `self`, `cls` or `super()`, is a reach when `_name` is a private name that some
  ddpgraph module defines (at module or class level, or as an attribute set on `self`)
  and the reading module does not define itself: module-private is Python's convention.
  The rule leaves out the internals of PyTorch and other libraries this project needs
  (`torch._C`, `torch._foreach_*`, DDP's reducer, `sys._getframe`): their names are not
  defined here. Where such a name coincides with one ddpgraph defines, `FOREIGN` lists
  the (module, attribute) pair, with whose it is.
* Functions of at most 60 lines, decorators excluded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from design_rules import (
    SRC,
    architecture,
    core_modules,
    cycles,
    defined_private_names,
    docstring_line,
    import_graph,
    imports_above_core,
    is_alias,
    long_functions,
    module_name,
    named_paths,
    package_of,
    private_reaches,
    tree_sources,
)

README = SRC.parents[1] / "README.md"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400
# Another library's private names that coincide with a name ddpgraph defines.
FOREIGN = {
    (
        "backends/recording.py",
        "_version",
    ): "torch.Tensor's version counter, which in-place writes bump",
    ("doctor/observed.py", "_version"): "torch.Tensor's version counter",
    ("optimizer/hyperparam_slot.py", "_version"): "torch.Tensor's version counter",
    ("probe/probe_checks.py", "_version"): "torch.Tensor's version counter",
    ("family/graphs.py", "_snapshot"): "torch.cuda.memory._snapshot, the allocator's segments",
    (
        "integrations/lightning.py",
        "_result",
    ): "Lightning's closure result, which the callback hands back",
    ("training/scaler_steps.py", "_values"): "a sparse gradient's values",
}


def _rel(p: Path) -> str:
    return str(p.relative_to(SRC))


# ----------------------------------------------------------------- the layer rule
@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from .strategies.base import TrainStep\n", ["ddpgraph.strategies.base"]),
        ("from . import strategies\n", ["ddpgraph.strategies"]),
        (
            "def f():\n    from .training.scaler import GraphSafeGradScaler\n",
            ["ddpgraph.training.scaler"],
        ),
        ("import ddpgraph.app.cli\n", ["ddpgraph.app.cli"]),
        ("from ddpgraph.doctor import run\n", ["ddpgraph.doctor"]),
        (
            "import importlib\nimportlib.import_module('ddpgraph.bench.command')\n",
            ["ddpgraph.bench.command"],
        ),
        ("from .streams import capture_stream\nfrom . import ddp\nimport ddpgraph.errors\n", []),
        ("from .trainings import x\nfrom .strategies_like import y\n", []),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from .strategies.base import TrainStep\n",
            [],
        ),
    ],
)
def test_the_checker_finds_each_kind_of_import_above_the_core(
    source: str, expected: list[str]
) -> None:
    assert [module for _, module in imports_above_core(source)] == expected


def test_a_core_package_module_importing_a_layer_is_found() -> None:
    source = "from ..training.scaler import GraphSafeGradScaler\n"
    assert imports_above_core(source, ("ddpgraph", "cycle")) == [(1, "ddpgraph.training.scaler")]


@pytest.mark.parametrize(
    ("source", "alias"),
    [
        (
            '"""Moved."""\nfrom ._moved import moved\nfrom .app.cli import main\n'
            'moved("a", "b")\n__all__ = ["main"]\n',
            True,
        ),
        (
            '"""Alias."""\nfrom .integrations.lightning import CUDAGraphCallback\n'
            '__all__ = ["CUDAGraphCallback"]\n',
            True,
        ),
        ('"""Work."""\nfrom .app.cli import main\ndef f():\n    return main()\n', False),
        ('"""Work."""\nfrom .app import cli\nX = cli.main()\n', False),
    ],
)
def test_an_alias_is_a_module_that_only_re_exports(source: str, alias: bool) -> None:
    assert is_alias(source) is alias


def test_the_capture_core_imports_nothing_above_it() -> None:
    core = core_modules()
    names = {_rel(p) for p in core}
    assert (
        len(core) > 30 and "cycle/engine.py" in names and "findings.py" in names
    )  # the rule checks the real core
    assert "capture.py" not in names and "__init__.py" not in names
    offenders = [
        f"{_rel(p)}:{line} imports {module}"
        for p in core
        for line, module in imports_above_core(
            p.read_text(), package_of(module_name(p), p.name == "__init__.py")
        )
    ]
    assert offenders == [], "the capture core imports a layer built on it:\n" + "\n".join(offenders)


# ----------------------------------------------------------------- import cycles
def test_the_cycle_checker_finds_cycles_at_any_depth_and_only_run_time_ones() -> None:
    sources = {
        "ddpgraph.a": ("from . import b\n", False),
        "ddpgraph.b": ("def f():\n    from .a import x\n", False),
        "ddpgraph.c": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import y\n",
            False,
        ),
        "ddpgraph.d": ("from .c import z\n", False),
        "ddpgraph.p": ("from .q import x\n", True),
        "ddpgraph.p.q": ("from ..p import r\n", False),
        "ddpgraph.e": ("import ddpgraph.f\n", False),
        "ddpgraph.f": ("from ddpgraph.g import x\n", False),
        "ddpgraph.g": ("from ddpgraph import e\n", False),
    }
    graph = import_graph(sources)
    assert graph["ddpgraph.a"] == {"ddpgraph.b"} and graph["ddpgraph.c"] == set()
    assert cycles(graph) == [
        ["ddpgraph.a", "ddpgraph.b"],
        ["ddpgraph.e", "ddpgraph.f", "ddpgraph.g"],
        ["ddpgraph.p", "ddpgraph.p.q"],
    ]


def test_no_import_cycles_among_ddpgraphs_modules() -> None:
    sources = tree_sources()
    graph = import_graph(sources)
    assert len(graph) > 100 and graph["ddpgraph.cycle.engine"]  # the rule reads the real tree
    found = cycles(graph)
    assert found == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


# ----------------------------------------------------------------- private reaches
def test_the_private_reach_checker() -> None:
    engine = (
        "class Engine:\n    def __init__(self):\n        self._record = None\n"
        "    def _decide(self):\n        return self._record\n"
    )
    assert defined_private_names(engine) == {"_record", "_decide"}
    ours = defined_private_names(engine) | {"_hidden"}
    reader = (
        "import torch\n"
        "def f(step, m):\n"
        "    step._record = 1\n"  # a write
        "    step._decide()\n"  # a call
        "    getattr(step, '_record')\n"  # by name
        "    torch._C._foo\n"  # another library's internals
        "    m.__dict__\n"  # a dunder
        "    return m._hidden\n"
    )
    assert [r for _, r in private_reaches(reader, ours)] == [
        "step._record",
        "step._decide",
        "step._record",
        "m._hidden",
    ]
    # Within its own module, and on self or cls, a private name is the module's own.
    assert list(private_reaches(engine + "def g(other):\n    return other._record\n", ours)) == []
    assert (
        list(
            private_reaches(
                "class A:\n    def f(self):\n        return super()._decide(), self._hidden\n", ours
            )
        )
        == []
    )


def _ours() -> set[str]:
    names: set[str] = set()
    for p in SRC.rglob("*.py"):
        names |= defined_private_names(p.read_text())
    return names


def test_no_module_reaches_into_anothers_private_names() -> None:
    ours = _ours()
    assert {"_captured", "_decide", "_policy_running"} <= ours  # the rule knows the engine's names
    found = [
        (_rel(p), line, reach)
        for p in sorted(SRC.rglob("*.py"))
        for line, reach in private_reaches(p.read_text(), ours)
    ]
    offenders = [
        f"{path}:{line} {reach}"
        for path, line, reach in found
        if (path, reach.rsplit(".", 1)[1]) not in FOREIGN
    ]
    assert offenders == [], "a module reaches into another's private names:\n" + "\n".join(
        offenders
    )
    used = {(path, reach.rsplit(".", 1)[1]) for path, _, reach in found}
    stale = sorted(pair for pair in set(FOREIGN) - used if (SRC / pair[0]).exists())
    assert stale == [], f"FOREIGN lists pairs no longer read: {stale}"


# ----------------------------------------------------------------- function length
def test_the_function_length_checker_counts_methods_and_nested_functions() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    source = (
        f"def short():\n{body[: -len('    x59 = 59') - 1]}\nclass A:\n    @staticmethod\n"
        "    def long():\n" + body.replace("    ", "        ")
    )
    source += (
        "def outer():\n    def inner():\n" + body.replace("    ", "        ") + "    return inner\n"
    )
    assert list(long_functions(source, 60)) == [("A.long", 61), ("outer", 63), ("outer.inner", 61)]


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=_rel)
def test_no_function_is_over_60_lines(path: Path) -> None:
    long = [
        f"{name}: {lines} lines"
        for name, lines in long_functions(path.read_text(), MAX_FUNCTION_LINES)
    ]
    assert long == [], f"{_rel(path)}: functions over {MAX_FUNCTION_LINES} lines: {long}"


# ----------------------------------------------------------------- the layout
def test_no_module_is_over_400_lines() -> None:
    # A module a reader holds in one sitting: past that, it holds two concepts.
    long = {
        _rel(p): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: {long}"


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=_rel)
def test_every_module_says_what_lives_there(path: Path) -> None:
    assert docstring_line(path.read_text()), f"{_rel(path)} has no docstring"


def test_readme_architecture_names_only_paths_that_exist_and_every_package() -> None:
    section = architecture(README)
    named = named_paths(section)
    assert len(named) >= 10
    missing = sorted(
        n for n in named if not (SRC.parents[1] / n if n.startswith("src/") else SRC / n).exists()
    )
    assert missing == [], (
        f"README's architecture names paths that are not in src/ddpgraph: {missing}"
    )
    packages = {f"{p.parent.relative_to(SRC)}/" for p in SRC.glob("*/__init__.py")}
    assert packages - named == set(), "README's architecture leaves out a package"
