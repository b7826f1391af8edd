"""Python state outside the step that the step changes on every call: a list it appends
to, a counter it increments, an attribute of its own object, an iterator it takes the
next batch from. Eager training changes it on every call; a replay runs no Python, so
after capture it would stop changing while training goes on, without a word: a loss
history stops growing, a step counter the loop saves checkpoints by stops counting, and
a batch taken with `next(it)` inside the step is the recorded one on every replay.

What is watched is what the step's own code reaches by name, and nothing a library owns. The
roots are the free variables (closure cells) and globals that the step function's code names,
`self` of a bound method or of a callable object, the arguments a `functools.partial` holds,
the same of the user's functions these lead to (a helper the step calls), the model's modules
of classes defined in the user's files, and the hooks registered on its modules and
parameters (a forward hook that counts). From a root the walk enters plain containers (list,
tuple, dict, set, deque) and objects of classes defined in the user's files; it keeps plain
values (numbers, strings) by value, an iterator by how far it has gone, and a tensor by its
shape, dtype and device only: a step that rebinds `self.last_loss = loss.detach()` holds the
graph's output, which every replay refreshes. Objects of installed libraries, of torch and of
ddpgraph (an optimizer, a scheduler, a progress bar) are not entered: their state is theirs.

A change is a finding only when it happened in both of the last two watched warm-up
calls of one input signature: a cache filled once, or a value set to the same thing on
every call, is not one.
"""

from __future__ import annotations

import dis
import functools
import inspect
import operator
import sys
import types
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..findings import Location
from ..probe.code_origin import is_user_file
from ..step.write_sites import state_write_site

_MAX_DEPTH = 4  # containers entered below a root
_ENDS = 16  # items kept from each end of a long sequence
_MAX_ITEMS = 64  # entries kept of a dict or an object
_BUDGET = 4000  # values kept in one snapshot
_FOLLOW_DEPTH = 3  # how deep the user's functions are followed from the step

Changes = dict[str, tuple[Hashable, Hashable]]
# The user's subclasses of what torch and ddpgraph follow themselves: an optimizer's
# hyper-parameters and a scheduler's count (LR_BAKED_INTO_GRAPH), a data pipeline's
# own bookkeeping (a batch the step takes with `next(it)` is the iterator's).
_FOLLOWED_ELSEWHERE = (
    torch.optim.Optimizer,
    torch.optim.lr_scheduler.LRScheduler,
    torch.utils.data.Dataset,
    torch.utils.data.DataLoader,
    torch.utils.data.Sampler,
)


@dataclass(frozen=True)
class _Root:
    name: str  # as findings name it: `history`, `self`, `model.module.encoder`
    read: Callable[[], Any]  # read again at every snapshot: a global or a cell is rebound
    owner: Callable[..., Any] | None  # the user's function whose code names it
    alias: str = ""  # the name in the owner's code, where it is another (`self`)


class OutsideState:
    """The roots of one step function (and its model), and snapshots of what they hold."""

    def __init__(self, fn: Callable[..., Any], model: nn.Module | None = None) -> None:
        self._roots: list[_Root] = []
        self._followed: set[int] = set()
        self._functions: list[types.FunctionType] = []  # the user's, in the order reached
        try:
            self._visit(fn, 0)
            if model is not None:
                self._roots += [
                    _Root(f"model.{name}" if name else "model", _constant(m), forward, "self")
                    for name, m in model.named_modules()
                    if user_class(type(m)) and (forward := getattr(type(m), "forward", None))
                ]
                for hook in _registered_hooks(model):
                    self._visit(hook, 1)
        except Exception:  # a callable that will not be read: what was found is watched
            pass

    def snapshot(self, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, Hashable]:
        """path -> what is kept of the value there (`_leaf`, or a container's kind and size);
        the tensors themselves go into `tensors`, by path, when given.

        Never raises: a watch that raised on one rank would leave the others waiting in
        the next agreement; what could not be read is left out."""
        out: dict[str, Hashable] = {}
        budget = [_BUDGET]
        seen: set[int] = set()  # an object reached twice is kept under its first path
        for root in self._roots:
            try:
                _walk(root.read(), root.name, 0, out, budget, seen, tensors)
            except Exception:  # an empty cell, a global not bound yet, an odd object
                continue
        return out

    def changes(
        self, before: dict[str, Hashable], tensors: dict[str, torch.Tensor] | None = None
    ) -> Changes:
        """What differs now from `before`: path -> (before, now), None where absent; the
        tensors there now go into `tensors`, when given."""
        now = self.snapshot(tensors)
        try:
            return {
                path: (before.get(path), now.get(path))
                for path in dict.fromkeys([*before, *now])
                if before.get(path) != now.get(path)
            }
        except Exception:  # a value whose comparison raised: nothing is claimed
            return {}

    def roots(self) -> list[tuple[str, str, Callable[[], Any], Any, bool]]:
        """Each root: its name, the name the owner's code gives it (empty when the same),
        how to read it again, the user's function whose code names it, and whether it
        is fixed (the same object on every read: `self`, a partial's argument)."""
        return [
            (root.name, root.alias, root.read, root.owner, isinstance(root.read, _Fixed))
            for root in self._roots
        ]

    def write_site(self, path: str) -> Location | None:
        """The line of the user's code that writes `path`: searched in the source of the
        functions whose code names its root (one object can be reached from several),
        then in the other functions of the user's that the step leads to (a helper it
        passes the object to); else the first such function's first line."""
        roots = sorted(
            (
                r
                for r in self._roots
                if r.owner is not None
                and (path == r.name or path.startswith((f"{r.name}.", f"{r.name}[")))
            ),
            key=lambda r: -len(r.name),
        )
        named = [(r.owner, (r.alias or r.name) + path[len(r.name) :]) for r in roots]
        named += [(fn, path) for fn in self._functions]
        try:
            for owner, name in named:
                if owner is not None and (where := state_write_site(owner, name, or_start=False)):
                    return where
            first = next((owner for owner, _ in named if owner is not None), None)
            return state_write_site(first, path) if first is not None else None
        except Exception:  # a source that would not parse: the finding names no line
            return None

    # ----------------------------------------------------------------- roots
    def _add(self, root: _Root) -> None:
        """`root`, unless one of that name is there: the step's own names come first,
        and a helper's name for something else is told apart by the helper's name."""
        taken = next((r for r in self._roots if r.name == root.name), None)
        if taken is None:
            self._roots.append(root)
        elif root.owner is not None and taken.owner is not root.owner:
            name = f"{getattr(root.owner, '__qualname__', '?')}:{root.name}"
            if all(r.name != name for r in self._roots):
                self._roots.append(_Root(name, root.read, root.owner, root.alias or root.name))

    def _visit(self, fn: Any, depth: int) -> None:
        if depth > _FOLLOW_DEPTH:
            return
        try:
            fn = inspect.unwrap(fn)
        except ValueError:  # a cycle of __wrapped__
            return
        if isinstance(fn, functools.partial):
            self._partial(fn, depth)
        elif inspect.ismethod(fn):
            if _user_function(fn.__func__):
                self._add(_Root("self", _constant(fn.__self__), fn.__func__))
            self._visit(fn.__func__, depth)
        elif inspect.isfunction(fn):
            self._function(fn, depth)
        else:
            call = inspect.getattr_static(type(fn), "__call__", None)
            if inspect.isfunction(call) and _user_function(call):
                self._add(_Root("self", _constant(fn), call))
                self._function(call, depth)

    def _partial(self, fn: functools.partial[Any], depth: int) -> None:
        try:
            names = list(inspect.signature(fn.func).parameters)
        except (TypeError, ValueError):
            names = []
        for i, value in enumerate(fn.args):
            name = names[i] if i < len(names) else f"args[{i}]"
            self._add(_Root(name, _constant(value), fn.func))
        for name, value in fn.keywords.items():
            self._add(_Root(name, _constant(value), fn.func))
        self._visit(fn.func, depth)

    def _function(self, fn: types.FunctionType, depth: int) -> None:
        if id(fn) in self._followed:
            return
        self._followed.add(id(fn))
        cells = zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False)
        if not _user_function(fn):
            # ddpgraph's or a library's wrapper: the user's functions it holds are followed.
            for _, cell in cells:
                self._visit_value(_contents(cell), depth + 1)
            return
        self._functions.append(fn)
        for name, cell in cells:
            self._add(_Root(name, functools.partial(_contents, cell, strict=True), fn))
            self._visit_value(_contents(cell), depth + 1)
        for name in _global_names(fn.__code__):
            if name in fn.__globals__:
                value = fn.__globals__[name]
                if callable(value) and not _stateful(value):
                    self._visit_value(value, depth + 1)
                else:
                    self._add(_Root(name, functools.partial(_global, fn, name), fn))

    def _visit_value(self, value: Any, depth: int) -> None:
        if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
            self._visit(value, depth)


def _registered_hooks(model: nn.Module) -> Iterator[Any]:
    """The hooks on the model's modules and parameters: its forward and backward call
    them, so a counter one keeps is state the step changes too."""
    for module in model.modules():
        for table in (
            "_forward_pre_hooks",
            "_forward_hooks",
            "_backward_pre_hooks",
            "_backward_hooks",
        ):
            yield from (getattr(module, table, None) or {}).values()
    for parameter in model.parameters():
        for table in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            yield from (getattr(parameter, table, None) or {}).values()


def _contents(cell: Any, strict: bool = False) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        if strict:
            raise
        return None


def _global(fn: types.FunctionType, name: str) -> Any:
    return fn.__globals__[name]


class _Fixed:
    """The read of a root that cannot be rebound (`self`, a partial's argument)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self) -> Any:
        return self.value


def _constant(value: Any) -> Callable[[], Any]:
    return _Fixed(value)


def _stateful(value: Any) -> bool:
    """A callable that holds state of its own: an iterator, or an object of the user's."""
    return hasattr(type(value), "__next__") or user_class(type(value))


_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME"})


def _global_names(code: types.CodeType) -> Iterator[str]:
    """The globals `code` and the code nested in it read or write (not the attribute
    names, which share `co_names`: `opt.step()` does not name a global `step`)."""
    for instruction in dis.get_instructions(code):
        if instruction.opname in _GLOBAL_OPS and isinstance(instruction.argval, str):
            yield instruction.argval
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _user_function(fn: Any) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and is_user_file(code.co_filename)


def user_class(cls: type) -> bool:
    return _user_module(cls.__module__)


@functools.lru_cache(maxsize=4096)
def _user_module(name: str) -> bool:
    filename = getattr(sys.modules.get(name), "__file__", None)
    return isinstance(filename, str) and is_user_file(filename)


# ------------------------------------------------------------------ the walk
def _leaf(value: Any) -> Hashable | None:
    """What is kept of a value that is not entered; None for one that is entered or
    not watched."""
    if value is None or isinstance(value, (bool, int, str, bytes, complex)):
        return (type(value).__name__, value)
    if isinstance(value, float):
        return ("float", value if value == value else "nan")
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), str(value.device))
    if isinstance(value, torch.Size):
        return ("size", tuple(value))
    if type(value).__module__ == "numpy" and hasattr(value, "shape"):
        return ("numpy", repr(value) if value.size <= 8 else (value.shape, str(value.dtype)))
    if hasattr(type(value), "__next__"):
        return _iterator(value)
    return None


def _iterator(value: Any) -> Hashable:
    """How far an iterator has gone: what is left of a built-in one, how many batches a
    DataLoader's has given, a generator's plain locals, an `itertools.count`'s next."""
    frame = getattr(value, "gi_frame", None)
    locals_ = (
        tuple((k, v) for k, v in frame.f_locals.items() if isinstance(v, (bool, int, float, str)))
        if frame is not None
        else ()
    )
    given = getattr(value, "_num_yielded", None)  # torch's DataLoader iterators
    left = operator.length_hint(value, -1) if given is None else -1
    # `itertools.count(5)` shows where it is in its repr (the others' reprs say nothing).
    shown = repr(value) if type(value).__module__ == "itertools" else ""
    return ("iterator", type(value).__qualname__, left, given, locals_, shown)


def _walk(
    value: Any,
    path: str,
    depth: int,
    out: dict[str, Hashable],
    budget: list[int],
    seen: set[int],
    tensors: dict[str, torch.Tensor] | None,
) -> None:
    if budget[0] <= 0:
        return
    budget[0] -= 1
    try:
        leaf = _leaf(value)
    except Exception:  # a value that will not be read: left out
        return
    if leaf is not None:
        out[path] = leaf
        if tensors is not None and isinstance(value, torch.Tensor):
            tensors[path] = value
        return
    if id(value) in seen or depth > _MAX_DEPTH:
        return
    seen.add(id(value))
    try:
        children = list(_children(value, path, out))
    except Exception:  # a container that will not be read: left out
        return
    for child, child_path in children:
        _walk(child, child_path, depth + 1, out, budget, seen, tensors)


def _children(value: Any, path: str, out: dict[str, Hashable]) -> Iterator[tuple[Any, str]]:
    """The entries of a value that is entered; its kind and size go into `out`."""
    if isinstance(value, dict):
        out[path] = ("dict", len(value))
        for i, (key, child) in enumerate(list(value.items())[:_MAX_ITEMS]):
            yield child, f"{path}[{key!r}]" if isinstance(key, (str, int)) else f"{path}[#{i}]"
    elif isinstance(value, (list, tuple, deque)):
        n = len(value)
        out[path] = (type(value).__name__, n)
        shown = range(n) if n <= 2 * _ENDS else [*range(_ENDS), *range(n - _ENDS, n)]
        for i in shown:
            yield value[i], f"{path}[{i}]"
    elif isinstance(value, (set, frozenset)):
        out[path] = ("set", len(value), hash(frozenset(map(_leaf, value))))
    elif isinstance(value, types.SimpleNamespace) or (
        user_class(type(value)) and not isinstance(value, _FOLLOWED_ELSEWHERE)
    ):
        out[path] = ("object", type(value).__qualname__)
        attrs = getattr(value, "__dict__", {})
        module = isinstance(value, nn.Module)
        for name, child in list(attrs.items())[:_MAX_ITEMS]:
            # A module's own attributes are its and torch's (`_parameters`, `training`,
            # which a graph keeps per mode): only the public ones the user set are watched.
            if not module or not (name.startswith("_") or name == "training"):
                yield child, f"{path}.{name}"
        if module:  # the buffers the user's module keeps (a running statistic)
            for name, buffer in list(value.named_buffers(recurse=False))[:_MAX_ITEMS]:
                yield buffer, f"{path}.{name}"
