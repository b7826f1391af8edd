"""Adopting a DDP model that was built on another stream than the capture stream.

DDP's C++ reducer keeps one AccumulateGrad node per parameter for the model's lifetime
and hooks its all-reduce onto them. An AccumulateGrad node records the stream that was
current when it was created; a backward recorded on the capture stream then makes that
stream wait on the recorded one, and when that is the default stream CUDA invalidates
the capture ("operation failed due to a previous error during capture").

Two ways out, chosen by what the installed PyTorch has:

* `torch.autograd.graph.set_override_stale_capture_stream(True)`, where it exists: autograd
  itself replaces a stale stream by the capturing one during a capture.
* Otherwise the reducer is rebuilt in place, inside `torch.cuda.stream(capture_stream)`,
  the way DDP rebuilds it when it is unpickled. A parameter holds its accumulator only
  weakly, so once the old reducer is gone the new reducer's constructor creates fresh
  nodes on the current stream. Every DDP setting lives on the DDP object or is re-applied
  here (static graph, Python communication hooks), so the rebuilt reducer
  behaves like the old one, starting again from iteration 0.

Invariant: every rank adopts, or none does. Adoption is agreed before anything changes,
and the check that the nodes really are new is agreed after; the rebuild itself runs no
collective, and a rebuilt reducer is a working reducer, so a refusal after the rebuild
leaves DDP training eagerly exactly as before.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ..agreement.agree import Outcome, agree
from ..findings import Code, Finding
from . import build as ddp_tools
from .process import current_rank

Method = Literal["auto", "rebuild", "override"]
OVERRIDE_SWITCH = "set_override_stale_capture_stream"
_SUBJECT = "`capture_step(model=...)`"
# Tag written into the old nodes' metadata: a node that still carries it after the
# rebuild was kept alive by something else, and still records the old stream.
_OLD_NODE_TAG = "ddpgraph_replaced_accumulator"
_FIX_BUILD = (
    "build the model with `ddp = ddpgraph.prepare_ddp(model, device_ids=[local_rank])`, or "
    "build DDP inside `with torch.cuda.stream(s):` and pass `stream=s` to `capture_step`"
)


def has_override_switch() -> bool:
    """Whether this PyTorch can override stale accumulator streams during capture."""
    return callable(getattr(torch.autograd.graph, OVERRIDE_SWITCH, None))


def adopt_ddp(
    ddp: DDP, stream: torch.cuda.Stream | None, *, method: Method = "auto"
) -> Finding | None:
    """Make a DDP model built on another stream capturable on `stream`, on every rank.

    Call it on every rank at the same point, before any warm-up step on `stream`.
    Returns None when every rank adopted the model, and otherwise the agreed finding
    (code DDP_STREAM_MISMATCH) naming what stopped it; the model then trains eagerly
    as before. `method="auto"` uses PyTorch's override switch where it exists and
    rebuilds the reducer elsewhere; `stream=None` (CPU) rebuilds without a stream.
    """
    chosen = _choose(method)
    refusal = adoption_refusal(ddp, chosen)
    device = ddp_tools.model_device(ddp)
    decision = agree(
        Outcome(current_rank(), refusal is None, [refusal] if refusal else []),
        ddp.process_group,
        device,
    )
    if not decision.ok:
        return decision.summary()
    finding = apply_adoption(ddp, stream, method=chosen)
    decision = agree(
        Outcome(current_rank(), finding is None, [finding] if finding else []),
        ddp.process_group,
        device,
    )
    return None if decision.ok else decision.summary()


def apply_adoption(
    ddp: DDP, stream: torch.cuda.Stream | None, *, method: Method = "auto"
) -> Finding | None:
    """This rank's half of `adopt_ddp`, with no collective: the caller has agreed with the
    other ranks that every one adopts (no `adoption_refusal` anywhere), and agrees on the
    returned finding (what is left stale) at its next decision point."""
    chosen = _choose(method)
    finding: Finding | None = None
    if chosen == "override":
        # Process-global, and only ever makes a capture proceed that would otherwise
        # fail; other captures in the process are not changed otherwise.
        getattr(torch.autograd.graph, OVERRIDE_SWITCH)(True)
    else:
        stale = rebuild_reducer(ddp, stream)
        finding = _stale_finding(stale) if stale else None
    if finding is None and stream is not None:
        ddp_tools.mark_built_on(ddp, stream)
    return finding


def adoption_method() -> Literal["rebuild", "override"]:
    """How this PyTorch adopts a DDP model: its stale-stream override, or a rebuild."""
    return _choose("auto")


def adoption_refusal(ddp: DDP, method: Literal["rebuild", "override"]) -> Finding | None:
    """What stops this rank from adopting `ddp`, checked before anything changes."""
    if getattr(ddp, "_use_python_reducer", False):
        return _refusal(
            "this DistributedDataParallel model runs its Python reducer (compiled "
            "autograd), which has no C++ reducer to move to the capture stream"
        )
    if getattr(ddp, "mixed_precision", None) is not None:
        # Measured on an H200 (torch 2.11): a rebuilt reducer under DDP's prototype mixed
        # precision trained 7% apart from the same DDP not rebuilt, so it is not adopted.
        return _refusal(
            "this DistributedDataParallel model uses DDP's prototype `mixed_precision`, "
            "whose low-precision parameter copies and hooks a rebuilt reducer does not "
            "carry over exactly"
        )
    if getattr(ddp, "_delay_all_reduce_all_params", False):
        return _refusal(
            "every parameter of this DistributedDataParallel model is in "
            "`delay_all_reduce_named_params`, so it has no reducer to move to the capture stream"
        )
    if not ddp_tools.reducer_finalized(ddp):
        return _refusal(
            "this DistributedDataParallel model is in the middle of a backward pass (its "
            "reducer has not finished the last iteration)",
            "call `capture_step` between training steps, after `optimizer.step()`",
        )
    if method == "rebuild":
        builtin = builtin_comm_hook(ddp)
        if builtin is not None:
            return _refusal(
                f"this DistributedDataParallel model has the built-in communication hook "
                f"`{builtin}`, which DDP keeps no record of, so a rebuilt reducer could "
                "not carry it over",
                "register it after building the model with `ddpgraph.prepare_ddp(...)`, or "
                "use the equivalent Python hook (`ddp.register_comm_hook(state, hook)`), "
                "which is carried over",
            )
    return None


def builtin_comm_hook(ddp: DDP) -> str | None:
    """The name of a hook registered with `_register_builtin_comm_hook`, if any.

    DDP's logging data names the last registered hook; Python hooks are also listed in
    `ddp._comm_hooks`, built-in ones nowhere else.
    """
    try:
        name = str(ddp._get_ddp_logging_data().get("comm_hook", "") or "")
    except Exception:  # prototype API: without it only Python hooks are known
        return None
    python_hooks = {getattr(hook, "__qualname__", "") for hook, _ in _comm_hooks(ddp)}
    return name if name and name not in python_hooks else None


def rebuild_reducer(ddp: DDP, stream: torch.cuda.Stream | None) -> int:
    """Replace `ddp`'s reducer (and its gradient accumulators) by a new one built on
    `stream`, keeping every DDP setting. Runs no collective.

    Returns how many parameters kept their old accumulator because something else
    (usually a tensor from an earlier step holding its autograd graph) kept it alive.
    """
    ddp_: Any = ddp  # DDP's private attributes are not typed
    parameters, _ = ddp_._build_params_for_reducer()
    _tag_accumulators(parameters)
    hooks = _comm_hooks(ddp)
    # The logger holds the reducer and the reducer holds the accumulators: both must go
    # before the new reducer asks the parameters for their accumulators.
    ddp_.reducer = None
    ddp_.logger = None
    gc.collect()
    with _on(stream):
        _build_reducer(ddp_)
    ddp_._comm_hooks = []
    for hook, state in hooks:
        ddp_.register_comm_hook(state, hook)
    if ddp_.static_graph:
        ddp_.reducer._set_static_graph()
        ddp_.logger._set_static_graph()
        ddp_._static_graph_delay_allreduce_enqueued = False
    # The new reducer rebuilds its buckets after its first backward, as a new DDP does.
    ddp_._has_rebuilt_buckets = False
    ddp_tools.restart_counter(ddp)
    return _count_tagged(parameters)


def _build_reducer(ddp: Any) -> None:
    """DDP's own construction of the reducer and logger, as its `__setstate__` does it."""
    parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
    names = ddp._build_debug_param_to_name_mapping(parameters)
    ddp._ddp_init_helper(parameters, expect_sparse_gradient, names, ddp.static_graph)


def _choose(method: Method) -> Literal["rebuild", "override"]:
    if method == "auto":
        return "override" if has_override_switch() else "rebuild"
    return method


def _comm_hooks(ddp: DDP) -> list[tuple[Any, Any]]:
    return list(getattr(ddp, "_comm_hooks", []) or [])


@contextmanager
def _on(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Build on `stream`, ordered after the caller's work and before what follows."""
    if stream is None:
        yield
        return
    caller = torch.cuda.current_stream(stream.device)
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        yield
    caller.wait_stream(stream)


def _accumulator(param: torch.Tensor) -> Any:
    # The documented way to reach a leaf's AccumulateGrad node; creates it when absent.
    grad_fn: Any = param.expand_as(param).grad_fn
    return grad_fn.next_functions[0][0]


def _tag_accumulators(parameters: list[torch.Tensor]) -> None:
    for param in parameters:
        _accumulator(param).metadata[_OLD_NODE_TAG] = True


def _count_tagged(parameters: list[torch.Tensor]) -> int:
    return sum(1 for p in parameters if _OLD_NODE_TAG in _accumulator(p).metadata)


def _stale_finding(stale: int) -> Finding:
    return _refusal(
        f"{stale} of the model's gradient accumulators are still held by an autograd graph "
        "from an earlier step (a loss or output tensor kept alive), so they keep the stream "
        "DDP was built on",
        "call `capture_step` before the first training step, or delete the tensors of earlier "
        f"steps (`del loss`) before it; or {_FIX_BUILD}",
    )


def _refusal(happened: str, fix: str = _FIX_BUILD) -> Finding:
    return Finding(Code.DDP_STREAM_MISMATCH, happened, fix, subject=_SUBJECT)
