"""The arguments of a captured step: their signature, and the static buffers a graph reads.

A CUDA graph reads its inputs from the addresses it was recorded with. Every call
therefore copies each tensor argument into a buffer made at capture ("static input"),
and a call whose arguments differ in shape, dtype, device, structure or non-tensor
values must not be replayed at all.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..errors import DdpGraphUsageError
from ..findings import Code, Finding

_PLAIN_LEAVES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.Size,
    enum.Enum,
    slice,
    type(Ellipsis),
)


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        return cls(tuple(t.shape), t.dtype, t.device, t.requires_grad)

    def matches(self, t: torch.Tensor) -> bool:
        return (
            t.shape == self.shape
            and t.dtype == self.dtype
            and t.device == self.device
            and t.requires_grad == self.requires_grad
        )

    def __str__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        grad = ", requires_grad" if self.requires_grad else ""
        return f"{tuple(self.shape)} {dtype} on {self.device}{grad}"


@dataclass(frozen=True)
class _FlatTensors:
    """Spec of the common call `step(t1, t2, ...)` with tensors only: flattening it
    through pytree costs tens of microseconds per call, this costs nothing."""

    count: int


def flatten_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    if not kwargs and all(type(a) is torch.Tensor for a in args):
        return list(args), _FlatTensors(len(args))
    return pytree.tree_flatten((args, kwargs))


def unflatten_call(leaves: list[Any], spec: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(spec, _FlatTensors):
        return tuple(leaves), {}
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    return tuple(args), dict(kwargs)


def leaf_paths(
    args: tuple[Any, ...], kwargs: dict[str, Any], fn: Callable[..., Any] | None = None
) -> list[str]:
    """Readable names of the flattened leaves: `args[0]`, `kwargs['batch'][1]`; with the
    step function `fn`, its parameters' names where they bind (`i` for `args[2]` of
    `step(x, y, i)`, `batch[1]` for `kwargs['batch'][1]`), the names in the user's code."""
    positional = _positional_names(fn, len(args))
    pairs, _ = pytree.tree_flatten_with_path((args, kwargs))
    names = []
    for path, _leaf in pairs:
        head, rest = path[0], path[1:]
        first = rest[0] if rest else None
        key, index = getattr(first, "key", None), getattr(first, "idx", None)
        if getattr(head, "idx", 0) != 0:  # kwargs
            named = fn is not None and isinstance(key, str)
            names.append(
                f"{key}{pytree.keystr(rest[1:])}" if named else "kwargs" + pytree.keystr(rest)
            )
        elif index in positional:
            names.append(positional[index] + pytree.keystr(rest[1:]))
        else:
            names.append("args" + pytree.keystr(rest))
    return names


def _positional_names(fn: Callable[..., Any] | None, count: int) -> dict[int, str]:
    """{index: name} of `fn`'s parameters that the first `count` positional arguments bind
    to; none past a `*args` (those have no name of their own)."""
    if fn is None:
        return {}
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin, or a callable without a signature
        return {}
    named: dict[int, str] = {}
    for i, p in enumerate(parameters[:count]):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        named[i] = p.name
    return named


def check_supported(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse arguments that could hide tensors from the copy into static inputs."""
    leaves, _ = flatten_call(args, kwargs)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, (torch.Tensor, *_PLAIN_LEAVES)):
            continue
        name = leaf_paths(args, kwargs)[i]
        raise DdpGraphUsageError(
            Finding(
                Code.UNSUPPORTED_INPUT,
                f"argument `{name}` is a {type(leaf).__name__}, which ddpgraph cannot look "
                "inside; tensors in it would not be copied into the graph's inputs",
                subject="`capture_step` call",
            )
        )


def _flat_metas(leaves: list[torch.Tensor]) -> list[tuple[Any, ...]]:
    return [(x.shape, x.dtype, x.device, x.requires_grad) for x in leaves]


class Signature:
    """What must stay the same between the captured call and a replayed one."""

    def __init__(self, leaves: list[Any], spec: Any, paths: list[str]) -> None:
        self.spec = spec
        self.paths = paths
        self.leaves: list[TensorMeta | Any] = [
            TensorMeta.of(x) if isinstance(x, torch.Tensor) else x for x in leaves
        ]
        # `step(t1, t2, ...)`: the same facts as `TensorMeta.matches`, compared as one list
        # of tuples in C (shape as a `torch.Size`, so that it compares in C too).
        self._flat = _flat_metas(leaves) if isinstance(spec, _FlatTensors) else None

    def matches(self, leaves: list[Any], spec: Any) -> bool:
        """The per-call check; kept to comparisons, since it runs before every replay."""
        if self._flat is not None and type(spec) is _FlatTensors:
            return _flat_metas(leaves) == self._flat
        if len(leaves) != len(self.leaves) or spec != self.spec:
            return False
        for want, got in zip(self.leaves, leaves, strict=True):
            if isinstance(want, TensorMeta):
                if not isinstance(got, torch.Tensor) or not want.matches(got):
                    return False
            elif not _same_constant(want, got):
                return False
        return True

    def describe_change(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        # Always through pytree here, so both sides are described the same way.
        leaves, spec = pytree.tree_flatten((args, kwargs))
        captured = _tree_spec(self.spec)
        if spec != captured or len(leaves) != len(self.leaves):
            return (
                f"the structure of the arguments changed from {len(self.leaves)} leaves "
                f"({_outline(captured)}) to {len(leaves)} leaves ({_outline(spec)})"
            )
        for name, want, got in zip(self.paths, self.leaves, leaves, strict=True):
            if isinstance(want, TensorMeta):
                if not isinstance(got, torch.Tensor):
                    return (
                        f"input `{name}` changed from a tensor {want} to "
                        f"{type(got).__name__} {got!r}"
                    )
                if not want.matches(got):
                    return f"input `{name}` changed from {want} to {TensorMeta.of(got)}"
            elif not _same_constant(want, got):
                return f"argument `{name}` changed from {want!r} to {got!r}"
        return "the arguments are unchanged"


def _tree_spec(spec: Any) -> Any:
    if isinstance(spec, _FlatTensors):
        return pytree.tree_structure((tuple(range(spec.count)), {}))
    return spec


def _same_constant(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


def _outline(spec: Any) -> str:
    text = str(spec)
    return text if len(text) <= 120 else text[:117] + "..."


class StaticInputs:
    """Buffers the graph reads, one per tensor argument, and the copy into them.

    CPU tensors are staged onto `device`: the step function receives device tensors in
    every phase (warm-up, capture, replay, eager), so `.to(device)` inside it is a no-op
    instead of a host copy that capture would reject. Copies from pinned memory are
    asynchronous.
    """

    def __init__(self, leaves: list[Any], spec: Any, device: torch.device | None) -> None:
        self.device = device
        self.spec = spec
        self.buffers: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                with torch.no_grad():
                    buf = torch.empty_like(leaf, device=stage_device(leaf, device))
                    buf.copy_(leaf, non_blocking=True)
                self.buffers.append(buf.requires_grad_(leaf.requires_grad))
            else:
                self.buffers.append(leaf)
        self._grad_buffers = any(
            isinstance(b, torch.Tensor) and b.requires_grad for b in self.buffers
        )

    def call_args(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return unflatten_call(self.buffers, self.spec)

    def copy_in(self, leaves: list[Any]) -> None:
        """Copy a call the signature serves into the buffers. Only a buffer that requires
        grad needs grad mode off for its in-place copy; a served call's tensors require
        grad exactly where the buffers do, and entering `no_grad` costs about what a small
        copy does, so the usual call does without."""
        if self._grad_buffers:
            with torch.no_grad():
                self._copy(leaves)
        else:
            self._copy(leaves)

    def _copy(self, leaves: list[Any]) -> None:
        for buf, leaf in zip(self.buffers, leaves, strict=True):
            if isinstance(leaf, torch.Tensor) and leaf is not buf:
                buf.copy_(leaf, non_blocking=True)


def stage_device(t: torch.Tensor, device: torch.device | None) -> torch.device:
    if device is not None and device.type == "cuda" and t.device.type == "cpu":
        return device
    return t.device


def stage_leaves(leaves: list[Any], device: torch.device | None) -> list[Any]:
    """Eager-path counterpart of `StaticInputs`: CPU tensors moved to `device`; `leaves`
    itself when none needs moving."""
    if device is None or device.type != "cuda":
        return leaves
    if not any(isinstance(x, torch.Tensor) and x.device.type == "cpu" for x in leaves):
        return leaves
    return [
        x.to(device, non_blocking=True)
        if isinstance(x, torch.Tensor) and x.device.type == "cpu"
        else x
        for x in leaves
    ]
