"""Partial capture: CUDA graphs of submodules' forward and backward, DDP left eager.

For a step that cannot be captured whole (a host synchronisation you cannot remove,
control flow on tensor values between modules), the submodules that contain no
collective and no synchronisation can still be recorded, each as a forward graph and a
backward graph (`torch.cuda.make_graphed_callables`). The step itself stays eager: DDP's
gradient hooks, its all-reduces and the optimizer step run as usual, between graphs.

    model = ddpgraph.graph_submodules(model, (sample_x,), amp_dtype=torch.bfloat16)
    ddp = ddpgraph.prepare_ddp(model)

`graph_submodules` runs one forward of the model on the sample arguments to learn what
each submodule receives, then graphs either the submodules you name or the largest ones
that can be graphed: starting from the whole model, a module that fails (a host
synchronisation inside, a capture error, results unlike eager) is replaced by its
children. Each candidate is graphed on every rank and kept only if every rank graphed it
and its forward outputs and gradients equal the eager ones.

A graphed submodule replays only calls like the recorded one: same shapes, dtypes,
`requires_grad`, autocast state and train mode. Any other call runs the original
forward (and warns once), so odd batches and evaluation stay correct.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .agreement import Outcome, agree
from .backends import settle_after_failed_capture
from .ddp import inner_module, model_device, process_group_of
from .diagnose import finding_from_error
from .distributed import current_rank
from .errors import DdpGraphError, DdpGraphWarning, usage_error
from .findings import Code, Finding
from .inputs import Signature, flatten_call, leaf_paths, stage_leaves, unflatten_call
from .probe import classify, host_sync_probe
from .streams import can_run_graphs

# Replaces `module.forward` by a graphed forward built from `sample_args`; raises if it
# cannot. The CUDA one is `torch.cuda.make_graphed_callables`; tests use stand-ins.
Grapher = Callable[[nn.Module, tuple[torch.Tensor, ...]], None]
_HANDLE_ATTR = "_ddpgraph_partial"
# Graphs replay eager's kernels: a real fault differs by O(1), while atomics in some
# backward kernels may flip a rounding here and there.
DEFAULT_TOLERANCE = 1e-3
MAX_ATTEMPTS = 64


def cuda_grapher(module: nn.Module, sample_args: tuple[torch.Tensor, ...]) -> None:
    # allow_unused_input: parameters a forward does not use get no gradient, as in eager.
    torch.cuda.make_graphed_callables(module, sample_args, allow_unused_input=True)


# ---------------------------------------------------------------------- autocast state
@dataclass(frozen=True)
class AutocastState:
    enabled: bool
    dtype: torch.dtype

    @classmethod
    def current(cls, device_type: str) -> AutocastState:
        try:
            enabled = torch.is_autocast_enabled(device_type)
            dtype = torch.get_autocast_dtype(device_type)
        except (TypeError, AttributeError):  # PyTorch before 2.4: CUDA-only queries
            enabled = torch.is_autocast_enabled() if device_type == "cuda" else False
            dtype = torch.get_autocast_gpu_dtype()
        return cls(bool(enabled), dtype)

    def recording(self, device_type: str) -> AbstractContextManager[Any]:
        """The autocast to graph under: the recorded one, with its weight-cast cache off
        (casts cached during a capture would be graph memory reused by eager ops)."""
        if not self.enabled:
            return nullcontext()
        return torch.autocast(device_type, dtype=self.dtype, cache_enabled=False)


# ---------------------------------------------------------------------- recording calls
@dataclass
class CallRecord:
    """The first call of one submodule during the recorded forward."""

    module: nn.Module
    calls: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    training: bool
    grad_enabled: bool
    autocast: AutocastState
    syncs: list[Any] = field(default_factory=list)  # host syncs seen inside it


def _detached(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """Recorded arguments without their autograd history. Kept with it, they would keep
    the sample forward's autograd graph alive, and with it the parameters' gradient
    accumulators bound to the stream the sample ran on, which then breaks the capture of
    backward ("operation would make the legacy stream depend on a capturing blocking
    stream"), as seen on an H200 when graphing a model on the default stream."""
    return tuple(
        v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
        for v in values
    )


class SubmoduleRecorder:
    """Forward hooks on every submodule of `root` for one forward: each submodule's first
    arguments, call count and state, and (with `sync_events`, the list a
    `host_sync_probe` fills) the host synchronisations made inside it."""

    def __init__(self, root: nn.Module, sync_events: list[Any] | None = None) -> None:
        self.root = root
        self.records: dict[str, CallRecord] = {}
        self._events = sync_events if sync_events is not None else []
        self._starts: dict[str, list[int]] = {}
        self._handles: list[Any] = []
        self._device_type = model_device(root).type

    def __enter__(self) -> SubmoduleRecorder:
        for name, module in self.root.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._starts.setdefault(name, []).append(len(self._events))
            record = self.records.get(name)
            if record is not None:
                record.calls += 1
                return
            self.records[name] = CallRecord(
                module,
                1,
                _detached(args),
                {k: _detached((v,))[0] for k, v in kwargs.items()},
                module.training,
                torch.is_grad_enabled(),
                AutocastState.current(self._device_type),
            )

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            start = self._starts[name].pop()
            if len(self._events) > start:
                self.records[name].syncs.extend(self._events[start:])

        return hook


# ---------------------------------------------------------------------- graphed forward
class GraphedForward:
    """Installed as a submodule's `forward`: replays its graphs for calls like the
    recorded one, and runs the original forward for any other call."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        original: Callable[..., Any],
        signature: Signature,
        autocast: AutocastState,
        grad_storage: list[tuple[nn.Parameter, int]],
    ) -> None:
        self.name = name
        self.module = module
        self.graphed: Callable[..., Any] = module.forward
        self.original = original
        self.signature = signature
        self.autocast = autocast
        self.device_type = model_device(module).type
        self.grad_storage = grad_storage
        self.replays = 0
        self.fallbacks = 0
        self.last_fallback = ""
        self.bypass = False  # run the original forward (eager reference runs)

    def install(self) -> None:
        self.module.forward = self  # type: ignore[method-assign]

    def uninstall(self) -> None:
        _restore_forward(self.module, self.original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.bypass or not self.module.training:
            return self.original(*args, **kwargs)  # graphed in train mode only
        leaves, spec = flatten_call(args, kwargs)
        if not self.signature.matches(leaves, spec):
            return self._fallback(self.signature.describe_change(args, kwargs), args, kwargs)
        now = AutocastState.current(self.device_type)
        if now != self.autocast:
            return self._fallback(f"autocast changed from {self.autocast} to {now}", args, kwargs)
        self._detach_grads_from_graph()
        self.replays += 1
        return self.graphed(*args)

    def _detach_grads_from_graph(self) -> None:
        # Autograd may keep the tensor a graphed backward returns as `param.grad`. If
        # that gradient is not reset to None before the next backward (zero_grad with
        # set_to_none=False, gradient accumulation), the replay would overwrite it
        # before autograd adds the new gradient to it: give it its own memory first.
        for param, storage in self.grad_storage:
            grad = param.grad
            if grad is not None and grad.data_ptr() == storage:
                param.grad = grad.clone()

    def _fallback(self, why: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.fallbacks += 1
        if not self.last_fallback:
            finding = Finding(
                Code.INPUT_SIGNATURE_CHANGED,
                f"{why}; this call runs the original forward",
                "keep the calls of graphed submodules like the sample (same shapes, dtypes, "
                "autocast), or graph with samples like the real calls",
                subject=f"graphed submodule `{self.name or type(self.module).__name__}`",
            )
            warnings.warn(f"{finding.format()}\n(Warned once for this submodule.)", DdpGraphWarning, stacklevel=3)
        self.last_fallback = why
        return self.original(*args, **kwargs)


# ---------------------------------------------------------------------- the report
@dataclass(frozen=True)
class Skipped:
    name: str
    why: str
    finding: Finding | None = None


@dataclass
class PartialReport:
    """What `graph_submodules` graphed, what it left eager and why, and how the graphed
    submodules have been used since."""

    graphed: list[str]
    skipped: list[Skipped]
    seconds: float
    forwards: list[GraphedForward] = field(default_factory=list, repr=False)

    @property
    def replays(self) -> dict[str, int]:
        return {f.name: f.replays for f in self.forwards}

    @property
    def fallbacks(self) -> dict[str, int]:
        return {f.name: f.fallbacks for f in self.forwards}

    def format(self) -> str:
        lines = [f"graphed {len(self.graphed)} submodule(s) in {self.seconds:.2f} s: "
                 + (", ".join(_label(n) for n in self.graphed) or "none")]
        lines += [f"  left eager: {_label(s.name)}: {s.why}" for s in self.skipped]
        return "\n".join(lines)


def _label(name: str) -> str:
    return f"`{name}`" if name else "the whole model"


class PartialGraphs:
    """The graphed forwards of one model; `release()` puts the original forwards back
    and frees the graphs."""

    def __init__(self, root: nn.Module, report: PartialReport) -> None:
        self.root = root
        self.report = report

    @contextmanager
    def bypassed(self) -> Iterator[None]:
        """Inside the block, every graphed submodule runs its original forward."""
        for forward in self.report.forwards:
            forward.bypass = True
        try:
            yield
        finally:
            for forward in self.report.forwards:
                forward.bypass = False

    def release(self) -> None:
        for forward in reversed(self.report.forwards):
            forward.uninstall()
        self.report.forwards.clear()
        if getattr(self.root, _HANDLE_ATTR, None) is self:
            delattr(self.root, _HANDLE_ATTR)


# ---------------------------------------------------------------------- graphing
@dataclass
class _Settings:
    grapher: Grapher
    tolerance: float
    group: Any
    device: torch.device
    device_type: str


def graph_recorded(
    root: nn.Module,
    records: dict[str, CallRecord],
    *,
    names: Sequence[str] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    grapher: Grapher | None = None,
    group: Any = None,
    max_attempts: int = MAX_ATTEMPTS,
) -> PartialGraphs:
    """Graph submodules of `root` from a recorded forward, agreeing with the other ranks
    of `group` on each. `names` graphs exactly those (raising `DdpGraphError` if one
    cannot be graphed); None graphs the largest ones that can be, at most
    `max_attempts` tries."""
    start = time.perf_counter()
    device = model_device(root)
    settings = _Settings(grapher or cuda_grapher, tolerance, group, device, device.type)
    modules = dict(root.named_modules())
    graphed: list[GraphedForward] = []
    skipped: list[Skipped] = []
    if names is not None:
        for name in names:
            forward, skip = _attempt(name, modules[name], records.get(name), settings)
            if forward is None:
                for done in reversed(graphed):
                    done.uninstall()
                assert skip is not None
                raise DdpGraphError(
                    skip.finding
                    or Finding(
                        Code.CAPTURE_FAILED,
                        skip.why,
                        "name submodules that are called once per forward, with tensor arguments",
                        subject=f"submodule {_label(name)}",
                    )
                )
            graphed.append(forward)
    else:
        # Breadth first from the whole model: a module is tried before its children,
        # which are tried only if it cannot be graphed.
        queue, attempts = [""], 0
        while queue and attempts < max_attempts:
            name = queue.pop(0)
            module = modules[name]
            if not any(True for _ in module.parameters()):
                continue
            record = records.get(name)
            attempts += _ineligible(module, record) is None
            forward, skip = _attempt(name, module, record, settings)
            if forward is not None:
                graphed.append(forward)
                continue
            if skip is not None and record is not None:  # containers are not called themselves
                skipped.append(skip)
            queue += [f"{name}.{child}" if name else child for child, _ in module.named_children()]
    report = PartialReport([f.name for f in graphed], skipped, time.perf_counter() - start, graphed)
    handle = PartialGraphs(root, report)
    setattr(root, _HANDLE_ATTR, handle)
    return handle


def _attempt(
    name: str, module: nn.Module, record: CallRecord | None, s: _Settings
) -> tuple[GraphedForward | None, Skipped | None]:
    """Graph one submodule on every rank, or say why not."""
    why = _ineligible(module, record)
    if why is not None:
        # The same on every rank (same model, same recorded forward): nothing to agree on.
        return None, Skipped(name, why)
    assert record is not None
    subject = f"submodule {_label(name)}"
    if record.syncs:
        found = classify(record.syncs[0].stack) or Finding(Code.HOST_SYNC_IN_CAPTURE, "an operation waits for the GPU")
        finding = Finding(found.code, found.happened, found.fix, subject, found.location)
        return None, Skipped(name, finding.happened, finding)
    args = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in stage_leaves(list(record.args), s.device))
    original = module.forward
    forward: GraphedForward | None = None
    failure: Finding | None = None
    saved = _LocalState(module)
    try:
        reference = _forward_backward(module, args, record.autocast, s.device_type)
        saved.restore()
        with record.autocast.recording(s.device_type):
            s.grapher(module, args)
        saved.restore()
        got = _forward_backward(module, args, record.autocast, s.device_type)
        saved.restore()
        diff = relative_difference(got.tensors(), reference.tensors())
        if diff > s.tolerance:
            failure = Finding(
                Code.CAPTURE_FAILED,
                f"its graphed forward and backward differ from eager by {diff:.1e} "
                f"(relative; tolerance {s.tolerance:.0e})",
                "leave it eager, or name smaller submodules",
                subject=subject,
            )
        else:
            leaves, spec = flatten_call(args, {})
            storage = [(p, g.data_ptr()) for p, g in zip(got.params, got.param_grads, strict=True) if g is not None]
            forward = GraphedForward(
                name, module, original, Signature(leaves, spec, leaf_paths(args, {})), record.autocast, storage
            )
    except Exception as exc:  # a failed capture, or an operation a graph cannot hold
        _settle(s.device)
        saved.restore()
        found = finding_from_error(exc)
        failure = Finding(found.code, found.happened, found.fix, subject, found.location)
    decision = agree(Outcome(current_rank(), failure is None, [failure] if failure else []), s.group, s.device)
    if decision.ok and forward is not None:
        forward.install()
        return forward, None
    _restore_forward(module, original)
    first = decision.findings[0] if decision.findings else failure
    return None, Skipped(name, first.happened if first else "graphed on some ranks only", first)


def _ineligible(module: nn.Module, record: CallRecord | None) -> str | None:
    """Why `module` cannot be graphed from this record, or None."""
    if record is None:
        return "not called during the recorded forward"
    if record.calls > 1:
        return f"called {record.calls} times per forward; a graphed call's outputs are overwritten by the next"
    if record.kwargs:
        return f"called with keyword arguments ({', '.join(record.kwargs)})"
    if not record.args or not all(isinstance(a, torch.Tensor) for a in record.args):
        return "called with arguments that are not all tensors"
    if not record.training or not record.grad_enabled:
        return "not called in train mode with gradients enabled"
    if any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
        return "contains SyncBatchNorm, which runs collectives"
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
        return "has module hooks"
    if "forward" in module.__dict__:
        return "its forward was already replaced"
    if any(b.requires_grad for b in module.buffers()):
        return "has a buffer that requires grad"
    return None


def _restore_forward(module: nn.Module, original: Callable[..., Any]) -> None:
    """Put `original` back as `module.forward`: as the class's method when it is one."""
    if getattr(original, "__self__", None) is module and getattr(original, "__func__", None) is type(module).forward:
        module.__dict__.pop("forward", None)
    else:
        module.forward = original  # type: ignore[method-assign]


def _settle(device: torch.device) -> None:
    if can_run_graphs(device):
        settle_after_failed_capture(device)


class _LocalState:
    """A submodule's buffers and the RNG states: graphing runs warm-up iterations, which
    must leave the training state as it was."""

    def __init__(self, module: nn.Module) -> None:
        self._buffers = [(b, b.detach().clone()) for b in module.buffers()]
        self._cpu = torch.get_rng_state()
        self._cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def restore(self) -> None:
        with torch.no_grad():
            for b, v in self._buffers:
                b.copy_(v)
        torch.set_rng_state(self._cpu)
        if self._cuda is not None:
            torch.cuda.set_rng_state_all(self._cuda)


@dataclass
class _Pass:
    outputs: list[torch.Tensor]
    input_grads: list[torch.Tensor | None]
    params: list[nn.Parameter]
    param_grads: list[torch.Tensor | None]
    buffers: list[torch.Tensor]

    def tensors(self) -> list[torch.Tensor | None]:
        return [*self.outputs, *self.input_grads, *self.param_grads, *self.buffers]


def _forward_backward(module: nn.Module, args: tuple[Any, ...], autocast: AutocastState, device_type: str) -> _Pass:
    """One forward and backward with fixed output gradients; gradients are returned, not
    accumulated into `.grad`, so no DDP hook fires and no gradient changes."""
    with autocast.recording(device_type):
        out = module(*args)
    outputs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    differentiable = [o for o in outputs if o.requires_grad]
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    params = [p for p in module.parameters() if p.requires_grad]
    gen = torch.Generator(device=outputs[0].device if outputs else "cpu").manual_seed(0)
    grads: Sequence[torch.Tensor | None] = [None] * (len(inputs) + len(params))
    if differentiable:
        grads = torch.autograd.grad(
            differentiable,
            [*inputs, *params],
            grad_outputs=[torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype) for o in differentiable],
            allow_unused=True,
        )
    return _Pass(
        [o.detach().clone() for o in outputs],
        [g.detach().clone() if g is not None else None for g in grads[: len(inputs)]],
        params,
        list(grads[len(inputs) :]),
        [b.detach().clone() for b in module.buffers()],
    )


def relative_difference(got: Sequence[torch.Tensor | None], want: Sequence[torch.Tensor | None]) -> float:
    """||got - want|| / ||want|| over all tensors together: one flipped rounding in a large
    tensor hardly counts, a wrong result counts fully. inf when shapes or presence differ."""
    num = den = 0.0
    for a, b in zip(got, want, strict=True):
        if a is None or b is None:
            if a is not b:
                return math.inf
            continue
        if a.shape != b.shape:
            return math.inf
        num += float((a.detach().double() - b.detach().double()).pow(2).sum())
        den += float(b.detach().double().pow(2).sum())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)


# ---------------------------------------------------------------------- public API
def graph_submodules(
    model: nn.Module,
    sample_args: tuple[Any, ...],
    sample_kwargs: dict[str, Any] | None = None,
    *,
    names: Sequence[str] | None = None,
    amp_dtype: torch.dtype | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    grapher: Grapher | None = None,
) -> nn.Module:
    """Graph submodules of `model` (forward and backward each as CUDA graphs) and return
    `model`, changed in place. Call it on every rank, before wrapping the model in DDP
    (`prepare_ddp` or `DistributedDataParallel`; a DDP model's `.module` is graphed):
    DDP's hooks and all-reduces then run eagerly between the graphs.

    Arguments:
        model: the model, in train mode, on its GPU.
        sample_args, sample_kwargs: arguments of one forward like the training ones
            (same shapes and dtypes; integer inputs must be valid, e.g. token ids).
        names: the submodules to graph (`model.named_modules()` names, "" for the whole
            model); a name that cannot be graphed raises `DdpGraphError`. None: graph
            the largest submodules that can be (whole model first, then children).
        amp_dtype: the `torch.autocast` dtype the training step uses (e.g.
            torch.bfloat16), so the graphs hold the same kernels; None for no autocast.
        tolerance: the largest relative difference from eager (norm of the difference
            over norm, for outputs, gradients and buffers together) a graphed submodule
            may have on the sample; graphs replay the same kernels, so a real fault
            shows as a difference of order one.
        grapher: what records a submodule; None is `torch.cuda.make_graphed_callables`.

    The sample forward, the graphing and its checks leave parameters, buffers (batch-norm
    statistics) and RNG states as they were. `partial_report(model)` says what was
    graphed and why the rest was not; `ungraph_submodules(model)` undoes it all.
    """
    root = inner_module(model)
    if not isinstance(root, nn.Module):
        raise usage_error("`graph_submodules(model)`", f"expected a torch.nn.Module, got {type(model).__name__}", "pass the model to train")
    if not isinstance(sample_args, tuple):
        raise usage_error(
            "`graph_submodules(sample_args=...)`",
            f"expected a tuple of forward arguments, got {type(sample_args).__name__}",
            "pass `(x,)` for a model called as `model(x)`",
        )
    known = dict(root.named_modules())
    unknown = [n for n in names or () if n not in known]
    if unknown:
        raise usage_error(
            "`graph_submodules(names=...)`",
            f"expected names from `model.named_modules()`, got {', '.join(map(repr, unknown))}",
            "print `[n for n, _ in model.named_modules()]` to see them ('' is the whole model)",
        )
    device = model_device(root)
    if grapher is None and not can_run_graphs(device):
        raise usage_error(
            "`graph_submodules(model)`",
            f"expected a model on a CUDA device, got one on {device}",
            "move the model to its GPU first: `model.to(local_rank)`",
        )
    if getattr(root, _HANDLE_ATTR, None) is not None:
        raise usage_error(
            "`graph_submodules(model)`",
            "this model's submodules are already graphed",
            "call `ddpgraph.ungraph_submodules(model)` first to graph it differently",
        )
    records = record_forward(root, sample_args, sample_kwargs or {}, amp_dtype)
    group = process_group_of(model)
    graph_recorded(root, records, names=names, tolerance=tolerance, grapher=grapher, group=group)
    return model


def record_forward(
    root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], amp_dtype: torch.dtype | None
) -> dict[str, CallRecord]:
    """Run one forward of `root` with recording hooks, then undo its effects on buffers
    and RNG (the outputs are dropped; no backward runs)."""
    device = model_device(root)
    leaves, spec = flatten_call(args, kwargs)
    args, kwargs = unflatten_call(stage_leaves(leaves, device), spec)
    saved = _LocalState(root)
    cast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext()
    with torch.enable_grad(), record_step(root, probe=device.type == "cuda") as rec, cast:
        root(*args, **kwargs)
    saved.restore()
    return rec.records


@contextmanager
def record_step(root: nn.Module, *, probe: bool) -> Iterator[SubmoduleRecorder]:
    """Record the submodule calls of whatever runs inside (a real training step), with
    the host-sync probe on when `probe`."""
    with host_sync_probe(enabled=probe) as found, SubmoduleRecorder(root, found.events) as rec:
        yield rec


def partial_report(model: nn.Module) -> PartialReport | None:
    """What `graph_submodules` (or `strategy="partial"`) did to `model`, or None."""
    root = inner_module(model)
    handle = getattr(root, _HANDLE_ATTR, None)
    return handle.report if isinstance(handle, PartialGraphs) else None


def ungraph_submodules(model: nn.Module) -> None:
    """Put every graphed submodule's original forward back and free the graphs."""
    root = inner_module(model)
    handle = getattr(root, _HANDLE_ATTR, None)
    if isinstance(handle, PartialGraphs):
        handle.release()
