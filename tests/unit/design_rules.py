"""The checkers behind the design rules of `test_layout.py`, on source text, so that each
can be tested on small snippets as well as run on the real tree."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "ddpgraph"
ABOVE_THE_CORE = (
    "ddpgraph.training",
    "ddpgraph.strategies",
    "ddpgraph.integrations",
    "ddpgraph.app",
    "ddpgraph.bench",
    "ddpgraph.doctor",
)
LAYERS = {name.split(".")[1] for name in ABOVE_THE_CORE}
# The API layer above the core and the strategies: it may import both.
API_LAYER = {"__init__.py", "__main__.py", "capture.py"}


# ----------------------------------------------------------------- modules
def module_name(path: Path, src: Path = SRC) -> str:
    parts = ("ddpgraph", *path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(name: str, is_package: bool) -> tuple[str, ...]:
    """The package a module's relative imports start from."""
    parts = tuple(name.split("."))
    return parts if is_package else parts[:-1]


def is_alias(source: str) -> bool:
    """A module whose only work is re-exporting names of another (a deprecated path or a
    short alias): its statements are imports, `__all__`, `moved(...)` and a `__main__`
    block that calls what it imported."""
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"]:
            continue
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func) == "moved"
        ):
            continue
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            continue
        return False
    return True


def _resolve(level: int, name: str | None, package: tuple[str, ...]) -> str:
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


def imported_modules(
    source: str, package: tuple[str, ...], known: Iterable[str] = ()
) -> list[tuple[int, str, bool]]:
    """(line, module, at module level) of every run-time import: `import`, `from ... import`
    (relative or absolute; `from . import x` names the module `x` where `x` is one of
    `known`) and `importlib.import_module("...")`. Imports under `if TYPE_CHECKING:` are
    annotations only and run nothing, so they are left out."""
    known = set(known)
    tree = ast.parse(source)
    skip = _type_checking_only(tree)
    top = {id(node) for node in tree.body}
    found: list[tuple[int, str, bool]] = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.level, node.module, package)
            named = [f"{base}.{alias.name}" for alias in node.names]
            if known:
                targets = sorted({n if n in known else base for n in named})
            else:
                targets = [base, *named]
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            targets = [node.args[0].value]
        if targets and node.lineno not in skip:
            found.extend((node.lineno, t, id(node) in top) for t in targets)
    return found


# ----------------------------------------------------------------- the layer rule
def imports_above_core(
    source: str, package: tuple[str, ...] = ("ddpgraph",)
) -> list[tuple[int, str]]:
    """(line, module) of every run-time import, at any depth, of a layer above the core."""
    found: dict[int, str] = {}
    for line, module, _ in imported_modules(source, package):
        if any(module == p or module.startswith(p + ".") for p in ABOVE_THE_CORE):
            found[line] = min(found.get(line, module), module)
    return sorted(found.items())


def core_modules(src: Path = SRC) -> list[Path]:
    """The capture core: every module but the layers above it, the API layer and aliases."""
    return [
        p
        for p in sorted(src.rglob("*.py"))
        if p.relative_to(src).parts[0] not in LAYERS
        and not (len(p.relative_to(src).parts) == 1 and p.name in API_LAYER)
        and not is_alias(p.read_text())
    ]


# ----------------------------------------------------------------- import cycles
def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the ddpgraph modules it imports, from {module: (source, is package)}.
    Every run-time import counts, at module level or in a function: a function-level
    import is still a dependency, and one that closes a cycle only hides it."""
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for name, (source, is_package) in sources.items():
        for _, module, _ in imported_modules(source, package_of(name, is_package), sources):
            if module in sources and module != name:
                graph[name].add(module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm),
    each sorted, and a module that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def tree_sources(src: Path = SRC) -> dict[str, tuple[str, bool]]:
    return {
        module_name(p, src): (p.read_text(), p.name == "__init__.py")
        for p in sorted(src.rglob("*.py"))
    }


# ----------------------------------------------------------------- private reaches
def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_private_names(source: str) -> set[str]:
    """The private names a module defines: module- and class-level names, and the
    attributes its methods set on `self` or `cls`."""
    names: set[str] = set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]:
        for stmt in scope.body:
            targets = (
                stmt.targets
                if isinstance(stmt, ast.Assign)
                else [stmt.target]
                if isinstance(stmt, ast.AnnAssign)
                else []
            )
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if _is_private(n)}


def private_reaches(source: str, ours: set[str]) -> Iterator[tuple[int, str]]:
    """(line, `x._name`) where a module reads or writes, on anything but `self`, `cls` or
    `super()`, a private name that one of `ours` defines and it does not define itself.
    `getattr`/`setattr`/`hasattr` with the name as a string count too."""
    own = defined_private_names(source)
    nodes = sorted(
        ast.walk(ast.parse(source)),
        key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)),
    )
    for node in nodes:
        if isinstance(node, ast.Attribute) and node.attr in ours and node.attr not in own:
            owner = ast.unparse(node.value)
            if owner not in ("self", "cls", "super()"):
                yield node.lineno, f"{owner}.{node.attr}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in ours
            and node.args[1].value not in own
        ):
            owner = ast.unparse(node.args[0])
            if owner not in ("self", "cls"):
                yield node.lineno, f"{owner}.{node.args[1].value}"


# ----------------------------------------------------------------- function length
def long_functions(source: str, limit: int) -> Iterator[tuple[str, int]]:
    """(qualified name, lines) of every function, method or nested function, decorators
    excluded, docstring included, over `limit` lines."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                if lines > limit:
                    yield name, lines
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(source), "")


def docstring_line(source: str) -> str:
    doc = ast.get_docstring(ast.parse(source)) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def architecture(readme: Path) -> str:
    text = readme.read_text()
    section = text.split("\n## Architecture\n", 1)[1]
    return section.split("\n## ", 1)[0]


def named_paths(section: str) -> set[str]:
    return set(re.findall(r"`([\w/]+(?:\.py|/))`", section))
