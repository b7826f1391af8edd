"""The plain values the step reads from outside it (a number in a closure, a global flag,
`cfg.scale` of a config object, `weights["aux"]` of a dict), kept when the graph is
recorded and compared before each replay.

A replay runs no Python: a step that reads `epoch` from the function around it, a global
`AUX_WEIGHT` or `args.mixup_alpha`, repeats the value it read while recorded, and a loop
that changes it after capture trains on with the old one, without a word. The warm-up
watch sees values that change from call to call; these change later (a new epoch, a flag
set at step 1000). What is kept is what the step's own code reads by name: a root that
holds a plain value, and the attribute and item reads its code makes on a root (two deep
at most: `cfg.loss.scale`), where they lead through data (a dict, a list, a namespace, an
object or module of the user's) to a plain value or a short sequence of them. Reading
them costs a few dictionary look-ups, so every replay is checked; one that finds a value
changed runs eagerly (`captured_step`), and a check call (`verify_every`) that follows
captures again with the new value. A module's float settings and its mode are
`ModuleModes`'s (MODULE_SETTING_CHANGED, MODEL_MODE_CHANGED), not kept here.
"""

from __future__ import annotations

import argparse
import contextlib
import dis
import functools
import inspect
import types
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch import nn

from ..findings import Code, Finding, Location
from ..probe.code_origin import is_user_file
from .call_lines import line_location
from .outside_state import OutsideState, user_class

# Loads of a name (not of an attribute of that name: `opt.epoch`); `self` and the other
# arguments are fast loads.
_NAME_LOADS = frozenset(
    {
        "LOAD_GLOBAL",
        "LOAD_DEREF",
        "LOAD_NAME",
        "LOAD_CLASSDEREF",
        "LOAD_FROM_DICT_OR_DEREF",
        "LOAD_FROM_DICT_OR_GLOBALS",
    }
)
_FAST_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW"})
_CONST_LOADS = frozenset({"LOAD_CONST", "LOAD_SMALL_INT"})
_PLAIN = (bool, int, float, str)
_SHORT = 16  # a list or tuple of plain values kept whole up to this length
_MAX_KEPT = 64  # values kept for one step: a bound on what each replay reads
_DEPTH = 2  # attribute and item reads followed after the root
_DATA = (types.SimpleNamespace, argparse.Namespace)

Path = tuple[tuple[str, Any], ...]  # ("attr", "scale"), ("item", "w")


class PlainRoots:
    """The plain values one step reads from outside it at capture, with their values then."""

    def __init__(self, state: OutsideState, modules: Collection[nn.Module] = ()) -> None:
        """`modules`: those whose float settings `ModuleModes` compares (the model's)."""
        self._kept: list[tuple[str, Callable[[], Any], Any, Location | None]] = []
        # Odd code or objects: what was found is kept. A rank that raised here, at
        # capture, would leave the others waiting.
        with contextlib.suppress(Exception):
            self._collect(state, frozenset(id(m) for m in modules))

    def _collect(self, state: OutsideState, covered: frozenset[int]) -> None:
        seen: set[Any] = set()
        for name, alias, read, owner, fixed in state.roots():
            for path, where in _root_reads(owner, alias or name, read):
                shown = name + "".join(f".{k}" if how == "attr" else f"[{k!r}]" for how, k in path)
                if len(self._kept) >= _MAX_KEPT:
                    break
                reader = _fast_reader(read(), path, covered) if fixed else None
                reader = reader or _reader(read, path, covered)
                try:
                    value = _kept_value(reader())
                    # One place read under two names (`m.config` and `model.config`) once.
                    holder = _reader(read, path[:-1], covered)() if path else None
                except Exception:  # an empty cell, a key not there, not plain: not kept
                    continue
                place = (id(holder), path[-1]) if path else shown
                if place in seen:
                    continue
                seen.add(place)
                self._kept.append((shown, reader, value, where))

    @property
    def names(self) -> list[str]:
        """The paths kept (`cfg.scale`, `model.blocks.0.attn.n_head`)."""
        return [name for name, *_ in self._kept]

    def changed(self, subject: str) -> Finding | None:
        """FROZEN_PYTHON_VALUE for the first value that differs now, or None. Never
        raises: a rank whose check raised would leave the others waiting."""
        for name, read, was, where in self._kept:
            try:
                now = read()
                if now is was:  # an unchanged attribute holds the very object: most reads
                    continue
                if isinstance(was, torch.Tensor):  # kept by identity: it was replaced
                    return _replaced(name, now, subject, where)
                now = _kept_value(now)
            except Exception:  # deleted since, or no longer plain: not ours to judge
                continue
            if type(now) is type(was) and now == was:
                continue
            return Finding(
                Code.FROZEN_PYTHON_VALUE,
                f"the step reads `{name}`, which was {_shown(was)} when the graph was "
                f"recorded and is {_shown(now)} now; a replay runs no Python, so it would go "
                f"on with {_shown(was)}",
                "pass it to the step as a device tensor it reads "
                f"(`step(x, y, torch.tensor({name}, device=...))`), move the Python that "
                "uses it out of the step, or build a new step after changing it; until "
                "then, such calls run eagerly",
                subject=subject,
                location=where,
            )
        return None


class _NotPlain(Exception):
    pass


def _replaced(name: str, now: Any, subject: str, where: Location | None) -> Finding:
    what = (
        f"another tensor ({tuple(now.shape)}, {now.dtype})"
        if isinstance(now, torch.Tensor)
        else f"{type(now).__name__}"
    )
    return Finding(
        Code.FROZEN_PYTHON_VALUE,
        f"the step reads `{name}`, a tensor, and it was replaced by {what} after the graph "
        "was recorded; a replay reads the tensor it was recorded with, so it would go on "
        "with the old values",
        f"write the new values into the tensor the graph reads (`{name}.copy_(new)`) "
        "instead of binding another, or build a new step after replacing it; until then, "
        "such calls run eagerly",
        subject=subject,
        location=where,
    )


def _kept_value(value: Any) -> Any:
    """The value as kept: a plain value itself, a short list or tuple of them as a tuple,
    a tensor itself (compared by identity: its values are the graph's to read)."""
    if value is None or type(value) in _PLAIN or isinstance(value, torch.Tensor):
        return value
    if type(value) in (list, tuple) and len(value) <= _SHORT:
        items = tuple(value)
        if all(v is None or type(v) in _PLAIN for v in items):
            return (type(value).__name__, items)
    raise _NotPlain


def _shown(value: Any) -> str:
    if type(value) is tuple and len(value) == 2 and value[0] in ("list", "tuple"):
        kind, items = value
        return repr(list(items) if kind == "list" else items)
    return repr(value)


# ------------------------------------------------------------------ reading again
def _reader(read: Callable[[], Any], path: Path, covered: frozenset[int]) -> Callable[[], Any]:
    def again() -> Any:
        value = read()
        for i, (kind, key) in enumerate(path):
            value = _enter(value, kind, key, covered, last=i == len(path) - 1)
        return value

    return again


def _fast_reader(root: Any, path: Path, covered: frozenset[int]) -> Callable[[], Any] | None:
    """For one read on a fixed root (`self.n_head` of a module, a partial's dict): the
    look-up in the dict that holds it, as `_enter` would make it, else None. A module's
    forward reads several such attributes, and each replay reads them all again."""
    if len(path) != 1:
        return None
    kind, key = path[0]
    try:
        _enter(root, kind, key, covered, last=True)
    except Exception:  # not followed at all: the general reader skips it the same way
        return None
    holder = root if kind == "item" else getattr(root, "__dict__", None)
    if type(holder) is dict and key in holder:
        return functools.partial(holder.__getitem__, key)
    if type(holder) is list:
        return functools.partial(holder.__getitem__, key)
    return None  # a class attribute, a tuple's item: read the general way


def _enter(obj: Any, kind: str, key: Any, covered: frozenset[int], *, last: bool) -> Any:
    """One attribute or item read, through data only: an instance's own `__dict__` (no
    property runs), a dict's or a sequence's item; anything else is not followed."""
    if kind == "item":
        if type(obj) is dict or (type(obj) in (list, tuple) and type(key) is int):
            return obj[key]
        raise _NotPlain
    if isinstance(obj, types.ModuleType):
        if not is_user_file(getattr(obj, "__file__", None) or ""):
            raise _NotPlain
    elif not (type(obj) in _DATA or user_class(type(obj))):
        raise _NotPlain
    # The instance's own, else a class attribute (`class Cfg: scale = 1.0`, later set on
    # the instance); a property or method found there is not plain, and not run.
    for attrs in (getattr(obj, "__dict__", None), *(vars(c) for c in type(obj).__mro__)):
        if isinstance(attrs, (dict, types.MappingProxyType)) and key in attrs:
            value = attrs[key]
            break
    else:
        raise _NotPlain
    # A module's mode, and the model's float settings, are ModuleModes' to compare.
    if (
        isinstance(obj, nn.Module)
        and last
        and (key == "training" or (type(value) is float and id(obj) in covered))
    ):
        raise _NotPlain
    return value


# ------------------------------------------------------------------ the reads in code
def _root_reads(
    owner: Callable[..., Any] | None, name: str, read: Callable[[], Any]
) -> Iterator[tuple[Path, Location | None]]:
    """The reads of a root in its owner's code, and, for a callable object of the user's
    (a loss object, a criterion module outside the model), the reads its own `forward`
    or `__call__` makes on `self`: the step calls it, so they are the step's reads."""
    yield from _reads(owner, name)
    try:
        value = read()
    except Exception:  # an empty cell: nothing to follow
        return
    if isinstance(value, type) or not user_class(type(value)):
        return
    method = "forward" if isinstance(value, nn.Module) else "__call__"
    code = inspect.getattr_static(type(value), method, None)
    if inspect.isfunction(code) and is_user_file(code.__code__.co_filename):
        yield from ((path, where) for path, where in _reads(code, "self") if path)


def _reads(fn: Callable[..., Any] | None, name: str) -> Iterator[tuple[Path, Location | None]]:
    """The reads of `name` in `fn`'s code (or code nested in it): the name itself (a
    closure's or a global's), then each chain of attribute and item reads on it, with
    the line of the read's end."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    if name == "self" and code.co_argcount:  # the method's first argument, by its name
        name = code.co_varnames[0]
    pending = [code]
    while pending:
        current = pending.pop(0)
        # A fast load is of the owner's own argument (`self`, a partial's argument); in
        # code nested in it, of a local of that code.
        loads = _NAME_LOADS | _FAST_LOADS if current is code else _NAME_LOADS
        ops = list(dis.get_instructions(current))
        for i, op in enumerate(ops):
            if op.argval == name and op.opname in loads:
                for path, end in _chain(ops, i):
                    yield path, _location(current, end)
        pending += [c for c in current.co_consts if hasattr(c, "co_code")]


def _chain(ops: list[dis.Instruction], at: int) -> Iterator[tuple[Path, dis.Instruction]]:
    """The load at `at` and the attribute and item reads that follow it directly."""
    path: Path = ()
    yield path, ops[at]
    i = at + 1
    while len(path) < _DEPTH and i < len(ops):
        op = ops[i]
        if op.opname == "LOAD_ATTR" and "NULL" not in op.argrepr:  # not a method's load
            path, i = (*path, ("attr", op.argval)), i + 1
        elif (
            op.opname in _CONST_LOADS
            and i + 1 < len(ops)
            and (
                ops[i + 1].opname == "BINARY_SUBSCR"
                or (ops[i + 1].opname == "BINARY_OP" and ops[i + 1].argrepr == "[]")
            )
        ):
            path, i, op = (*path, ("item", op.argval)), i + 2, ops[i + 1]
        else:
            return
        yield path, op


def _location(code: types.CodeType, op: dis.Instruction) -> Location | None:
    positions = getattr(op, "positions", None)
    line = getattr(positions, "lineno", None) or op.starts_line
    if not isinstance(line, int):
        return None
    return line_location((code.co_filename, code.co_firstlineno, line))
