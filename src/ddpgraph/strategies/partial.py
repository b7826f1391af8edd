"""Partial capture: CUDA graphs of submodules' forward and backward, DDP left eager.

For a step that cannot be captured whole (a host synchronisation you cannot remove,
control flow on tensor values between modules), the submodules that contain no
collective and no synchronisation can still be recorded, each as a forward graph and a
backward graph (`torch.cuda.make_graphed_callables`). The step itself stays eager: DDP's
gradient hooks, its all-reduces and the optimizer step run as usual, between graphs.

    from ddpgraph.strategies.partial import graph_submodules

    model = graph_submodules(model, (sample_x,), amp_dtype=torch.bfloat16)
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

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..agreement.agree import Outcome, agree
from ..backends.capture_mode import default_capture_mode
from ..ddp.build import inner_module, model_device, process_group_of
from ..ddp.process import current_rank
from ..ddp.streams import can_run_graphs
from ..errors import DdpGraphError, usage_error
from ..findings import Code, Finding
from ..inputs.arguments import Signature, flatten_call, leaf_paths, stage_leaves
from ..probe.diagnose import finding_from_error
from ..probe.syncs import classify
from .partial_check import forward_backward, relative_difference, settle
from .partial_graphed import (
    HANDLE_ATTR,
    GraphedForward,
    PartialGraphs,
    PartialReport,
    Skipped,
    label,
    restore_forward,
)
from .partial_record import CallRecord, LocalState, record_forward

__all__ = [
    "DEFAULT_TOLERANCE",
    "MAX_ATTEMPTS",
    "Grapher",
    "cuda_grapher",
    "graph_recorded",
    "graph_submodules",
    "partial_report",
    "ungraph_submodules",
]

# Replaces `module.forward` by a graphed forward built from `sample_args`; raises if it
# cannot. The CUDA one is `torch.cuda.make_graphed_callables`; tests use stand-ins.
Grapher = Callable[[nn.Module, tuple[torch.Tensor, ...]], None]


# Graphs replay eager's kernels: a real fault differs by O(1), while atomics in some
# backward kernels may flip a rounding here and there.
DEFAULT_TOLERANCE = 1e-3


MAX_ATTEMPTS = 64


# What records a submodule in place of `cuda_grapher`, for tests without a GPU: with one
# set, a model on the CPU is graphed by it. Tests set it with `monkeypatch.setattr`; no
# public function takes it.
_STAND_IN_GRAPHER: Grapher | None = None


def stand_in_grapher() -> Grapher | None:
    """The stand-in grapher tests installed, or None: `torch.cuda.make_graphed_callables`."""
    return _STAND_IN_GRAPHER


def cuda_grapher(module: nn.Module, sample_args: tuple[torch.Tensor, ...]) -> None:
    # allow_unused_input: parameters a forward does not use get no gradient, as in eager.
    # make_graphed_callables takes no capture mode: its graphs get ddpgraph's, so that a
    # DataLoader's pin-memory thread cannot break them (`capture_mode`).
    with default_capture_mode():
        torch.cuda.make_graphed_callables(module, sample_args, allow_unused_input=True)


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
                        subject=f"submodule {label(name)}",
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
    setattr(root, HANDLE_ATTR, handle)
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
    subject = f"submodule {label(name)}"
    if record.syncs:
        return None, _host_sync_skip(name, record, subject)
    args = tuple(
        a.detach().clone().requires_grad_(a.requires_grad)
        for a in stage_leaves(list(record.args), s.device)
    )
    original = module.forward
    forward: GraphedForward | None = None
    failure: Finding | None = None
    saved = LocalState(module)
    try:
        reference = forward_backward(module, args, record.autocast, s.device_type)
        saved.restore()
        with record.autocast.recording(s.device_type):
            s.grapher(module, args)
        saved.restore()
        got = forward_backward(module, args, record.autocast, s.device_type)
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
            forward = _graphed_forward(
                name, module, original, args, record, got.params, got.param_grads
            )
    except Exception as exc:  # a failed capture, or an operation a graph cannot hold
        settle(s.device)
        saved.restore()
        found = finding_from_error(exc)
        failure = Finding(found.code, found.happened, found.fix, subject, found.location)
    decision = agree(
        Outcome(current_rank(), failure is None, [failure] if failure else []), s.group, s.device
    )
    if decision.ok and forward is not None:
        forward.install()
        return forward, None
    restore_forward(module, original)
    first = decision.findings[0] if decision.findings else failure
    return None, Skipped(name, first.happened if first else "graphed on some ranks only", first)


def _host_sync_skip(name: str, record: CallRecord, subject: str) -> Skipped:
    """A submodule whose recorded forward waited for the GPU: a graph would not hold the
    wait, so it stays eager, with the finding of the first such operation."""
    found = classify(record.syncs[0].stack) or Finding(
        Code.HOST_SYNC_IN_CAPTURE, "an operation waits for the GPU"
    )
    finding = Finding(found.code, found.happened, found.fix, subject, found.location)
    return Skipped(name, finding.happened, finding)


def _graphed_forward(
    name: str,
    module: nn.Module,
    original: Callable[..., Any],
    args: tuple[Any, ...],
    record: CallRecord,
    params: list[nn.Parameter],
    grads: list[torch.Tensor | None],
) -> GraphedForward:
    """The forward to install for a submodule that graphed correctly. The storage of the
    gradients it produced is kept: a gradient still in the graph's memory at the next
    replay gets its own memory first, so the replay does not overwrite it."""
    leaves, spec = flatten_call(args, {})
    storage = [(p, g.data_ptr()) for p, g in zip(params, grads, strict=True) if g is not None]
    return GraphedForward(
        name,
        module,
        original,
        Signature(leaves, spec, leaf_paths(args, {})),
        record.autocast,
        storage,
    )


def _ineligible(module: nn.Module, record: CallRecord | None) -> str | None:
    """Why `module` cannot be graphed from this record, or None."""
    if record is None:
        return "not called during the recorded forward"
    if record.calls > 1:
        return (
            f"called {record.calls} times per forward; a graphed call's outputs "
            "are overwritten by the next"
        )
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


def graph_submodules(
    model: nn.Module,
    sample_args: tuple[Any, ...],
    sample_kwargs: dict[str, Any] | None = None,
    *,
    names: Sequence[str] | None = None,
    amp_dtype: torch.dtype | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
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

    The sample forward, the graphing and its checks leave parameters, buffers (batch-norm
    statistics) and RNG states as they were. `partial_report(model)` says what was
    graphed and why the rest was not; `ungraph_submodules(model)` undoes it all.
    """
    root = _checked_root(model, sample_args, names)
    records = record_forward(root, sample_args, sample_kwargs or {}, amp_dtype)
    group = process_group_of(model)
    graph_recorded(
        root, records, names=names, tolerance=tolerance, grapher=stand_in_grapher(), group=group
    )
    return model


def _checked_root(
    model: nn.Module, sample_args: tuple[Any, ...], names: Sequence[str] | None
) -> nn.Module:
    """The module `graph_submodules` graphs (a DDP model's `.module`); a usage error for
    arguments it cannot graph."""
    root = inner_module(model)
    if not isinstance(root, nn.Module):
        raise usage_error(
            "`graph_submodules(model)`",
            f"expected a torch.nn.Module, got {type(model).__name__}",
            "pass the model to train",
        )
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
    grapher = stand_in_grapher()
    if grapher is None and not can_run_graphs(device):
        raise usage_error(
            "`graph_submodules(model)`",
            f"expected a model on a CUDA device, got one on {device}",
            "move the model to its GPU first: `model.to(local_rank)`",
        )
    if getattr(root, HANDLE_ATTR, None) is not None:
        raise usage_error(
            "`graph_submodules(model)`",
            "this model's submodules are already graphed",
            "call `ddpgraph.strategies.partial.ungraph_submodules(model)` first "
            "to graph it differently",
        )
    return root


def partial_report(model: nn.Module) -> PartialReport | None:
    """What `graph_submodules` (or `strategy="partial"`) did to `model`, or None."""
    root = inner_module(model)
    handle = getattr(root, HANDLE_ATTR, None)
    return handle.report if isinstance(handle, PartialGraphs) else None


def ungraph_submodules(model: nn.Module) -> None:
    """Put every graphed submodule's original forward back and free the graphs."""
    root = inner_module(model)
    handle = getattr(root, HANDLE_ATTR, None)
    if isinstance(handle, PartialGraphs):
        handle.release()
