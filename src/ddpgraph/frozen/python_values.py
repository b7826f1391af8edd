"""The Python values a step feeds into its operations, watched over several steps.

A replay runs no Python: what the step's Python computed while the graph was recorded
(a float it scaled the loss by, an int it used as a size or an index, the branch it
took) is what every replay repeats. So before a step is captured, and at the periodic
check after (`value_checks`), its calls run under `ValueWatch`, a `TorchFunctionMode`
that sees every torch function the step's Python calls (`torch.*`, `Tensor` methods,
`torch.nn.functional`) with its arguments. What is not a tensor is kept, by value; a
tensor is kept as a mark only (its data is the graph's to carry). Two calls with the
same input signature that differ in such a value, or in which functions they called (a
Python branch), differ in something a replay would freeze.

The level is deliberate. A function mode sees what Python passes, and nothing else:
the backward, DDP's reducer and the optimizer's kernels run in C++ from what the
forward and the parameters decide, so an aten-level `TorchDispatchMode` would see more
operations without more Python values, at five times the cost per operation, and would
miss `torch.tensor(value)`, whose value hides inside a tensor by then.

Left to others, because they are watched with their own codes or vary legitimately:

* the optimizers' steps (one mark each, contents not watched): their hyper-parameters
  are Python numbers in their kernels, followed by `safe_optimizers` before every
  replay (LR_BAKED_INTO_GRAPH), and a scheduler changes them between steps on purpose;
* the call's own arguments: calls are compared only with calls of the same signature,
  and a non-tensor argument that changes is `checked_calls.unservable`'s (INPUT_SIGNATURE_CHANGED);
* profiler ranges (`record_function`), which no graph records;
* code compiled by torch.compile: a mode on the stack is one of Dynamo's guards, so the
  watch steps out around compiled modules and a compile wrapper around the model
  (`outside_compiled`), and the Python values a compiled forward reads are the guards'
  to check (`dynamo_guard_failures`).

Random numbers are tensors drawn on the device; DDP's bucket rebuild (iteration 2) and
optimizers' first-step state are long past when the watched steps run (the last
`WATCHED_STEPS` of warm-up).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.optim.optimizer as optimizer_module
from torch import nn
from torch.overrides import TorchFunctionMode

from ..findings import Location
from .call_lines import CallLine, call_line, line_location

# The probe step and the steps before it whose calls are watched: two to compare, and
# a third for the values the finding lists.
WATCHED_STEPS = 3
# How many values a finding lists, and how long each may be.


_compiling = torch.compiler.is_compiling


class _Tensor:
    """The mark a tensor argument leaves in a trace."""

    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _Tensor()
_TENSOR_TYPES = frozenset({torch.Tensor, nn.Parameter})
_NAN = "nan"  # NaN is not equal to itself; a NaN constant must not look like a change
_PLAIN = (
    int,
    str,
    bool,
    type(None),
    complex,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    slice,
)


def _value(v: Any) -> Any:
    """What a trace keeps of one argument: the value of a plain one, a mark for a
    tensor, the type of any other object (a generator, a module, a process group)."""
    if isinstance(v, torch.Tensor):
        return _TENSOR
    if isinstance(v, float):
        return v if v == v else _NAN
    if isinstance(v, _PLAIN) or v is Ellipsis:
        return v
    if isinstance(v, (list, tuple)):
        return tuple(_value(x) for x in v)
    if isinstance(v, dict):
        return tuple((k, _value(x)) for k, x in v.items())
    return type(v)


def call_name(func: Any) -> str:
    if isinstance(func, _OptimizerStep):
        return f"{func.name}.step()"
    try:
        return str(torch.overrides.resolve_name(func) or getattr(func, "__qualname__", func))
    except Exception:  # a callable torch cannot name
        return str(getattr(func, "__qualname__", func))


_IGNORED: dict[Any, bool] = {}


def _ignored(func: Any) -> bool:
    """Profiler ranges: named by the step, never part of a graph (decided once per function)."""
    try:
        return _IGNORED[func]
    except KeyError:
        name = str(getattr(func, "_qualified_op_name", "") or getattr(func, "__module__", "") or "")
        _IGNORED[func] = ignored = "profiler" in name
        return ignored
    except TypeError:  # not hashable
        return False


@dataclass(frozen=True)
class _OptimizerStep:
    """The mark an optimizer's step leaves in a trace, in place of what it called."""

    name: str


Entry = tuple[Any, tuple[Any, ...]]  # (function, what its arguments were)


@dataclass
class Divergence:
    """Where a call first differed from the reference call: the index of the first
    differing entry, the user's line there (None when this call ran out of entries
    first), and the entries at that index (None where a call had none)."""

    index: int
    entries: list[Entry | None]
    # The lines of this call's operation at that index and of the other call's (None
    # where there is none).
    line: CallLine | None = None
    other_line: CallLine | None = None

    @property
    def location(self) -> Location | None:
        return line_location(self.line)

    @property
    def is_branch(self) -> bool:
        """The calls ran different functions there (a Python branch), not one function
        with different arguments."""
        reference, current = self.entries[0], self.entries[-1]
        return reference is None or current is None or reference[0] != current[0]


class Trace:
    """The entries of one watched call."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.lines: list[CallLine | None] = []  # the user's line of each entry
        self.guard_failures: list[str] = []  # Dynamo's, during this call
        self.checked = False  # a check call after capture (`value_checks`), not a warm-up step
        # What the call changed of the Python state outside the step (`outside_state`).
        self.state_changes: dict[str, tuple[Any, Any]] = {}
        # Tensors outside the step that it read and then bound another tensor in place
        # of (`x = x * 0.9 + loss`): path -> the user's line of the read.
        self.replaced: dict[str, CallLine | None] = {}


class ValueWatch(TorchFunctionMode):
    """Records the calls of one step into `trace`; with a `reference`, notes the user's
    line at the first entry that differs from it (the stack is read only there).
    `targets`: ids of tensors whose first in-place write by a call (its first argument,
    as a scheduler's `fill_` of a mirrored learning rate) is noted in `target_lines`.
    `reads`: id -> path of tensors outside the step; the first call that takes one as an
    argument is noted in `read_lines`, by path."""

    def __init__(self, reference: Trace | None = None, targets: Collection[int] = ()) -> None:
        super().__init__()
        self._targets = frozenset(targets)
        self.target_lines: dict[int, CallLine | None] = {}
        self.reads: dict[int, str] = {}
        self.read_lines: dict[str, CallLine | None] = {}
        self.trace = Trace()
        self._reference = reference.entries if reference is not None else None
        self._reference_lines = reference.lines if reference is not None else []
        self.divergence: Divergence | None = None
        self._optimizer_depth = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # Dynamo tracing through this mode (a function compiled inside the step that
        # `outside_compiled` could not reach): pass through and record nothing, so
        # that the traced graph holds nothing of the watch.
        if self._optimizer_depth or _compiling() or _ignored(func):
            return func(*args, **kwargs)
        # Plain tensors are most arguments: marked without a call of `_value`.
        values = tuple([_TENSOR if type(a) in _TENSOR_TYPES else _value(a) for a in args])
        if kwargs:
            values += tuple((k, _value(v)) for k, v in kwargs.items())
        line = self._add((func, values))
        if self._targets and args and id(args[0]) in self._targets:
            self.target_lines.setdefault(id(args[0]), line)
        if self.reads:
            self._note_reads((*args, *kwargs.values()), line)
        return func(*args, **kwargs)

    def _note_reads(self, args: tuple[Any, ...], line: CallLine | None) -> None:
        for arg in args:
            # A tensor, or one in a list or tuple (`torch.cat([x, self.state])`).
            for item in arg if isinstance(arg, (list, tuple)) else (arg,):
                if isinstance(item, torch.Tensor) and id(item) in self.reads:
                    self.read_lines.setdefault(self.reads[id(item)], line)

    def _add(self, entry: Entry) -> CallLine | None:
        """Append `entry` with the user's line of the call (from the caller of the method
        calling this one), which it returns; note the first entry unlike the reference's."""
        entries = self.trace.entries
        ref = self._reference
        line = call_line(sys._getframe(2))
        if ref is not None and self.divergence is None:
            i = len(entries)
            if i >= len(ref) or ref[i] != entry:
                other = self._reference_lines[i] if i < len(self._reference_lines) else None
                reference = ref[i] if i < len(ref) else None
                self.divergence = Divergence(i, [reference, entry], line, other)
        entries.append(entry)
        self.trace.lines.append(line)
        return line

    def finish(self) -> None:
        """After the call: a reference longer than this call diverges where it ended."""
        ref = self._reference
        if ref is not None and self.divergence is None and len(ref) > len(self.trace.entries):
            i = len(self.trace.entries)
            self.divergence = Divergence(i, [ref[i], None])

    # Optimizer steps leave one mark (see the module docstring).
    def optimizer_started(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._optimizer_depth:
            self._add((_OptimizerStep(type(optimizer).__name__), ()))
        self._optimizer_depth += 1

    def optimizer_ended(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._optimizer_depth = max(0, self._optimizer_depth - 1)


@contextmanager
def watching(watch: ValueWatch, models: Sequence[nn.Module] = ()) -> Iterator[ValueWatch]:
    """Run the block under `watch`, out of the compiled code in or around `models`,
    with optimizer steps marked."""
    pre = getattr(optimizer_module, "register_optimizer_step_pre_hook", None)
    post = getattr(optimizer_module, "register_optimizer_step_post_hook", None)
    failures = _guard_failure_counts()
    with ExitStack() as stack:
        if pre is not None and post is not None:
            stack.callback(pre(watch.optimizer_started).remove)
            stack.callback(post(watch.optimizer_ended).remove)
        for model in models:
            outside_compiled(model, watch, stack)
        stack.enter_context(watch)
        try:
            yield watch
        finally:
            watch.finish()
    watch.trace.guard_failures = dynamo_guard_failures(failures)


def outside_compiled(model: nn.Module, watch: ValueWatch, stack: ExitStack) -> None:
    """Make every compiled module under `model` run with `watch` off the mode stack,
    until `stack` closes: Dynamo guards on the stack, so a mode on it would make it
    compile again, and then trace the mode (`module.compile()` replaces the whole call;
    a `torch.compile(module)` wrapper compiles its `forward`)."""
    for module in model.modules():
        compiled = module.__dict__.get("_compiled_call_impl")
        if compiled is not None:
            module._compiled_call_impl = _without(watch, compiled)
            stack.callback(setattr, module, "_compiled_call_impl", compiled)
        elif (
            hasattr(module, "_orig_mod")
            and hasattr(module, "dynamo_ctx")
            and "forward" in module.__dict__
        ):
            forward = module.__dict__["forward"]
            module.__dict__["forward"] = _without(watch, forward)
            stack.callback(module.__dict__.__setitem__, "forward", forward)


def _without(watch: ValueWatch, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        current = torch._C._len_torch_function_stack()
        if current and torch._C._get_function_stack_at(current - 1) is watch:
            with torch.overrides._pop_mode_temporarily():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


def _guard_failure_store() -> Any:
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    return getattr(dynamo_utils, "guard_failures", None)


def _guard_failure_counts() -> dict[Any, int]:
    store = _guard_failure_store()
    return {code: len(v) for code, v in store.items()} if store is not None else {}


def dynamo_guard_failures(before: dict[Any, int]) -> list[str]:
    """The reasons torch.compile's guards gave for failing since `before`
    (`_guard_failure_counts`, per compiled code object): a Python value a compiled
    frame read changed."""
    store = _guard_failure_store()
    if store is None:
        return []
    return [str(r) for code, v in list(store.items()) for r in v[before.get(code, 0) :]]
