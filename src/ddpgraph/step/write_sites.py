"""Where in the step's own source an argument, or state outside the step, is written,
for the finding that says so.

The probe step sees that an argument changed (its container got a new entry, a tensor's
values moved without its version counter: `count.data.add_(1)`) but not which line did
it: a dict's `__setitem__` and a write through `.data` leave no trace at run time. After
the fact, the step function's source is searched for the statement that writes the
argument by its parameter name; where none is found (the write is in a helper the step
calls), the step function's own first line is named.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import re
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

from ..findings import Location

# Methods that change a list, dict, set or deque in place.
_MUTATORS = frozenset(
    {
        "append",
        "extend",
        "insert",
        "pop",
        "remove",
        "clear",
        "update",
        "setdefault",
        "popitem",
        "sort",
        "reverse",
        "__setitem__",
        "add",  # a set's; a user's own `meter.add(v)` changes it too
        "discard",
        "appendleft",  # a deque's
        "extendleft",
        "popleft",
    }
)
_NAMED = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


def parameter_name(fn: Callable[..., Any], path: str) -> str | None:
    """The parameter of `fn` that receives the argument at `path`, a name that
    `inputs.arguments.leaf_paths` gave with `fn`: the parameter it starts with (`state['x']`:
    `state`), or, for a position it left unnamed (`args[3]`, past the named parameters),
    the `*args` parameter."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    named = _NAMED.match(path)
    root = named.group(0) if named else None
    if any(p.name == root and p.kind is not p.VAR_POSITIONAL for p in params):
        return root
    if not path.startswith("args["):
        return None
    return next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)


def def_location(fn: Callable[..., Any]) -> Location | None:
    """The line where the user's `fn` starts (through `functools.wraps` wrappers); None
    without code."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return None
    return Location(
        code.co_filename,
        code.co_firstlineno,
        linecache.getline(code.co_filename, code.co_firstlineno).strip(),
    )


def write_site(fn: Callable[..., Any], name: str | None, *, through_data: bool) -> Location | None:
    """The first line of `fn` that writes parameter `name`: into its container
    (`name[k] = v`, `del name[k]`, `name.append(v)`, ...), or, with `through_data`, its
    values through `.data` (`name.data.add_(1)`, `name.data[0] = v`). The line where `fn`
    starts when no such line is found; None without a source."""
    start = def_location(fn)
    if start is None or name is None:
        return start
    try:
        lines, first = inspect.getsourcelines(inspect.unwrap(fn))
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return start
    for node in _writes(tree, name, through_data):
        lineno = first + node.lineno - 1
        return Location(start.filename, lineno, linecache.getline(start.filename, lineno).strip())
    return start


def _writes(tree: ast.AST, name: str, through_data: bool) -> Iterator[ast.stmt | ast.expr]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            if any(_written_target(t, name, through_data) for t in targets):
                yield node
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, owner = node.func.attr, node.func.value
            if _rooted_at(owner, name) and (
                (through_data and method.endswith("_") and _through_data(owner))
                or (not through_data and method in _MUTATORS)
            ):
                yield node


def _written_target(target: ast.expr, name: str, through_data: bool) -> bool:
    if through_data:
        return (
            isinstance(target, (ast.Subscript, ast.Attribute))
            and _rooted_at(target, name)
            and _through_data(target)
        )
    return (
        isinstance(target, ast.Subscript) and _rooted_at(target, name) and not _through_data(target)
    )


def _chain(node: ast.expr) -> Iterator[ast.expr]:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        yield node
        node = node.func if isinstance(node, ast.Call) else node.value
    yield node


def _rooted_at(node: ast.expr, name: str) -> bool:
    *_, root = _chain(node)
    return isinstance(root, ast.Name) and root.id == name


def _through_data(node: ast.expr) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "data" for n in _chain(node))


_FIRST_PART = re.compile(
    r"(?P<root>[A-Za-z_][A-Za-z_0-9]*)(?:\.(?P<attr>[A-Za-z_][A-Za-z_0-9]*)|(?P<item>\[))?"
)


def state_write_site(
    fn: Callable[..., Any], path: str, *, or_start: bool = True
) -> Location | None:
    """The first line of `fn` that changes the state at `path` (`history`,
    `self.global_step`, `state['count']`, as `frozen.outside_state` names it): rebinds it
    (a `global` or `nonlocal` counter), assigns into it, calls a method that changes a
    list or dict, or takes its next item (`next(it)`). Matched by the path's root and
    its first attribute or index; when none matches, the line where `fn` starts
    (`or_start`) or None."""
    start = def_location(fn)
    parsed = _FIRST_PART.match(path)
    if parsed is None or start is None:
        return start if or_start else None
    root, attr, item = parsed["root"], parsed["attr"], parsed["item"] is not None
    try:
        lines, first = inspect.getsourcelines(inspect.unwrap(fn))
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return start if or_start else None

    def reaches(node: ast.expr, *, whole: bool) -> bool:
        chain = list(_chain(node))
        if not (isinstance(chain[-1], ast.Name) and chain[-1].id == root):
            return False
        if len(chain) == 1:
            return whole and attr is None and not item
        part = chain[-2]
        if attr is not None:
            return isinstance(part, ast.Attribute) and part.attr == attr
        return not item or isinstance(part, ast.Subscript)

    for node in ast.walk(tree):
        found = False
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            found = any(reaches(t, whole=True) for t in targets)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _MUTATORS:
                found = reaches(func.value, whole=attr is None and not item)
            elif isinstance(func, ast.Name) and func.id == "next" and node.args:
                found = reaches(node.args[0], whole=True)
        if found:
            lineno = first + node.lineno - 1  # type: ignore[attr-defined]
            filename = start.filename
            return Location(filename, lineno, linecache.getline(filename, lineno).strip())
    return start if or_start else None
