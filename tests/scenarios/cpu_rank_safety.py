"""Events on one rank only, on CPU processes with gloo, with either CPU backend
(`harness.backend()`).

Each scenario makes something happen on the last rank only (a checkpoint loaded, a
changed batch, a wrong argument, a hyper-parameter changed, optimizer state cleared, an
exception in the capture call) and reports what every rank ended in, per call, with the
losses of the same run trained eagerly, so the tests can check that all ranks took the
same path on the same call, in bounded time (the process group's timeout is short: a
rank left waiting fails the scenario), and that training equals eager training.
"""

from __future__ import annotations

import copy
import datetime
import time
import warnings
from collections.abc import Callable
from typing import Any

import harness
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ddpgraph
from ddpgraph.ddp.distributed import DistInfo

EVERY = 8  # `agree_every` of the captured runs: decisions come soon after an event
Event = Callable[[int, nn.Module, torch.optim.Optimizer], None]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _batches(info: DistInfo, n: int, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + info.rank)
    return [
        (torch.randn(size, 16, generator=gen), torch.randint(0, 4, (size,), generator=gen))
        for _ in range(n)
    ]


class StepFailed(ValueError):
    """What the step raises in the scenarios where it fails once."""


def _train_fn(
    model: nn.Module, opt: torch.optim.Optimizer, inside: Callable[[nn.Module], None] | None = None
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if inside is not None:
            inside(model)
        opt.step()
        return loss.detach()

    return train_step


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        model.parameters(), lr=1e-2, **harness.optimizer_kwargs(torch.optim.AdamW)
    )


def _run(
    info: DistInfo,
    batches: list[Any],
    event: Event | None,
    captured: bool,
    inside: Callable[[nn.Module], None] | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """Train DDP on `batches`, calling `event(i, model, opt)` before call i; captured or
    eager (with the same graph-safe optimizer). Stops at a `DdpGraphError`, except one
    raised by the step itself (`inside`, called by the step after backward): the loop
    then calls again with the same batch."""
    ddp = ddpgraph.prepare_ddp(_model())
    opt = _adamw(ddp)
    fn = _train_fn(ddp, opt, inside)
    step: Any = fn
    if captured:
        step = ddpgraph.capture_step(
            fn, model=ddp, optimizer=opt, backend=harness.backend(), agree_every=EVERY, **kw
        )
    else:
        ddpgraph.graph_safe_optimizer(opt, tensor_lr_on_cpu=True)
    losses: list[float] = []
    states: list[str] = []
    codes: list[str | None] = []
    raised: dict[str, Any] = {}
    retried: list[dict[str, Any]] = []
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(batches):
            if event is not None:
                event(i, ddp, opt)
            try:
                losses.append(float(step(x, y)))
            except (ddpgraph.DdpGraphError, StepFailed) as err:
                if (
                    isinstance(err, ddpgraph.DdpGraphError)
                    and err.code is not ddpgraph.Code.RANK_STOPPED
                ):
                    raised = {
                        "raised_at": i,
                        "raised_code": err.code.value,
                        "raised_ranks": list(err.finding.ranks),
                    }
                    break
                retried.append({"at": i, "own": isinstance(err, StepFailed), "text": str(err)})
                losses.append(float(step(x, y)))
            states.append(step.state.value if captured else "eager")
            codes.append(step.reason.code.value if captured and step.reason else None)
    out: dict[str, Any] = {
        "losses": losses,
        "states": states,
        "codes": codes,
        "params": harness.params_of(ddp),
        "retried": retried,
        **raised,
    }
    if captured:
        out.update(
            state=step.state.value,
            stats=vars(step.stats),
            code=step.reason.code.value if step.reason else None,
        )
        step.close()
    return out


def _compare(info: DistInfo, batches: list[Any], event: Event | None, **kw: Any) -> dict[str, Any]:
    got = _run(info, batches, event, True, **kw)
    kw.pop("inside", None)
    # The eager reference trains exactly the calls the captured run completed.
    ref = _run(info, batches[: len(got["losses"])], event, False)
    params = got.pop("params")
    return {
        **got,
        "loss_rel_diff": harness.loss_rel_diff(ref["losses"], got["losses"]),
        "param_rel_diff": harness.rel_diff(ref.pop("params"), params),
    }


def _on_last(
    info: DistInfo, at: int, action: Callable[[nn.Module, torch.optim.Optimizer], None]
) -> Event:
    def event(i: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        if i == at and info.rank == info.world_size - 1:
            action(model, opt)

    return event


def plain_module_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """A step on a model without DDP, built on rank 0 only (an EMA or teacher model)."""
    if info.rank != 0:
        return {"built": False}
    results = []
    for captured in (True, False):
        model = _model()
        opt = _adamw(model)
        fn = _train_fn(model, opt)
        step: Any = fn
        if captured:
            step = ddpgraph.capture_step(fn, model=model, optimizer=opt, backend=harness.backend())
        else:
            ddpgraph.graph_safe_optimizer(opt, tensor_lr_on_cpu=True)
        losses = [float(step(x, y)) for x, y in _batches(info, 12)]
        results.append((losses, getattr(step, "state", None)))
    (losses, state), (ref, _) = results
    return {
        "built": True,
        "state": state.value,
        "loss_rel_diff": harness.loss_rel_diff(ref, losses),
    }


def optimizer_load_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """After capture, the last rank loads an optimizer checkpoint with another structure
    (saved before any state existed)."""
    saved: dict[str, Any] = {}

    def event(i: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        if i == 0:
            saved["sd"] = copy.deepcopy(opt.state_dict())
        if i == 14 and info.rank == info.world_size - 1:
            opt.load_state_dict(saved["sd"])

    return _compare(info, _batches(info, 40), event)


def input_raise_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """`on_input_change="raise"`, and the last rank gets a smaller batch once."""
    batches = _batches(info, 40)
    if info.rank == info.world_size - 1:
        batches[14] = _batches(info, 1, size=5)[0]
    return _compare(info, batches, None, on_input_change="raise")


def usage_error_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """A warm-up too short for DDP on the last rank only: every rank raises."""
    ddp = ddpgraph.prepare_ddp(_model())
    opt = _adamw(ddp)
    warmup = 5 if info.rank == info.world_size - 1 else None
    try:
        ddpgraph.capture_step(
            _train_fn(ddp, opt),
            model=ddp,
            optimizer=opt,
            backend=harness.backend(),
            warmup_steps=warmup,
        )
    except ddpgraph.DdpGraphUsageError as err:
        return {
            "raised": True,
            "code": err.code.value,
            "ranks": list(err.finding.ranks),
            "lr_is_float": isinstance(opt.param_groups[0]["lr"], float),
        }
    return {"raised": False}


def warmup_differs_by_rank(info: DistInfo) -> dict[str, Any]:
    """Each rank asks for another warm-up: all capture on the same call, the longest."""
    return _compare(info, _batches(info, 20), None, warmup_steps=11 + info.rank)


def hyperparameter_raise_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """`on_failure="raise"`; after capture the last rank changes a Python hyper-parameter."""
    return _compare(
        info, _batches(info, 40), _on_last(info, 14, _set_weight_decay), on_failure="raise"
    )


def hyperparameter_eager_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """The same with `on_failure="eager"`: every rank ends eager, on the same call."""
    return _compare(info, _batches(info, 40), _on_last(info, 14, _set_weight_decay))


def state_cleared_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """After capture, the last rank clears its optimizer state by hand."""
    return _compare(info, _batches(info, 40), _on_last(info, 14, lambda m, o: o.state.clear()))


def _set_weight_decay(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.param_groups[0]["weight_decay"] = 0.5


def non_optimizer_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """The last rank passes something else than an optimizer in `optimizer=`."""
    ddp = ddpgraph.prepare_ddp(_model())
    opt = _adamw(ddp)
    given: list[Any] = [opt, "adamw"] if info.rank == info.world_size - 1 else [opt]
    try:
        ddpgraph.capture_step(
            _train_fn(ddp, opt), model=ddp, optimizer=given, backend=harness.backend()
        )
    except ddpgraph.DdpGraphUsageError as err:
        return {
            "raised": True,
            "code": err.code.value,
            "ranks": list(err.finding.ranks),
            "text": str(err),
        }
    return {"raised": False}


def unsupported_argument_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """The last rank's first call passes an object ddpgraph cannot look inside."""
    ddp = ddpgraph.prepare_ddp(_model())
    opt = _adamw(ddp)
    fn = _train_fn(ddp, opt)
    step = ddpgraph.capture_step(
        lambda x, y, meta=None: fn(x, y), model=ddp, optimizer=opt, backend=harness.backend()
    )
    x, y = _batches(info, 1)[0]
    meta = object() if info.rank == info.world_size - 1 else None
    try:
        step(x, y, meta=meta)
    except ddpgraph.DdpGraphUsageError as err:
        return {
            "raised": True,
            "code": err.code.value,
            "ranks": list(err.finding.ranks),
            "calls": step.stats.calls,
        }
    finally:
        step.close()
    return {"raised": False}


def _raise_once_on_last(info: DistInfo, due: Callable[[], bool]) -> Callable[[nn.Module], None]:
    state = {"raised": False}

    def inside(model: nn.Module) -> None:
        if info.rank == info.world_size - 1 and not state["raised"] and due():
            state["raised"] = True
            raise StepFailed("bad batch on the last rank")

    return inside


def step_raises_in_capture_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """The last rank's step raises once, in the capture call (after its backward); the
    loop catches it, on every rank, and calls again with the same batch."""
    calls = {"n": 0}

    def counting(i: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        calls["n"] = i

    return _compare(
        info,
        _batches(info, 20),
        counting,
        inside=_raise_once_on_last(info, lambda: calls["n"] == 11),
    )


STOP_TIMEOUT_S = 5  # the process group of the stopping scenarios: their peers wait this long


def _stopping(info: DistInfo, stop: Callable[[int], str | None]) -> dict[str, Any]:
    """Captured training on a process group of its own (which the failed collective
    leaves broken; the harness's group stays usable), where the last rank, before call
    i, does what `stop(i)` says: "skip" the call, "stop" calling (then waits as long as
    its peers do before leaving the loop), or nothing."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=STOP_TIMEOUT_S))
    ddp = ddpgraph.prepare_ddp(_model(), process_group=group)
    opt = _adamw(ddp)
    step = ddpgraph.capture_step(
        _train_fn(ddp, opt), model=ddp, optimizer=opt, backend=harness.backend(), agree_every=EVERY
    )
    out: dict[str, Any] = {"raised": None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (x, y) in enumerate(_batches(info, 30)):
            what = stop(i) if info.rank == info.world_size - 1 else None
            if what == "skip":
                continue
            if what == "stop":
                time.sleep(STOP_TIMEOUT_S + 1)  # alive while its peers wait for it
                break
            try:
                step(x, y)
            except ddpgraph.DdpGraphError as err:
                out["raised"] = {"at": i, "code": err.code.value, "text": str(err)}
                break
    out.update(calls=step.stats.calls, state=step.state.value)
    step.close()
    return out


def stops_calling_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """After capture, the last rank stops calling the step before call 20."""
    return _stopping(info, lambda i: "stop" if i == 20 else None)


def skips_a_call_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """After capture, the last rank skips call 20 (its loop caught an exception there)."""
    return _stopping(info, lambda i: "skip" if i == 20 else None)


REGISTRY_MORE = {
    "stops_calling_on_one_rank": stops_calling_on_one_rank,
    "skips_a_call_on_one_rank": skips_a_call_on_one_rank,
    "non_optimizer_on_one_rank": non_optimizer_on_one_rank,
    "unsupported_argument_on_one_rank": unsupported_argument_on_one_rank,
    "step_raises_in_capture_on_one_rank": step_raises_in_capture_on_one_rank,
}


REGISTRY = {
    "plain_module_on_one_rank": plain_module_on_one_rank,
    "optimizer_load_on_one_rank": optimizer_load_on_one_rank,
    "input_raise_on_one_rank": input_raise_on_one_rank,
    "usage_error_on_one_rank": usage_error_on_one_rank,
    "warmup_differs_by_rank": warmup_differs_by_rank,
    "hyperparameter_raise_on_one_rank": hyperparameter_raise_on_one_rank,
    "hyperparameter_eager_on_one_rank": hyperparameter_eager_on_one_rank,
    "state_cleared_on_one_rank": state_cleared_on_one_rank,
    **REGISTRY_MORE,
}
# A rank left alone in a collective fails its scenario in 30 s (test_rank_safety_gloo).
REGISTRY = harness.with_group_timeout(REGISTRY, 30)

if __name__ == "__main__":
    harness.run(REGISTRY)
