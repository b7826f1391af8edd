"""Core capture logic on CPU processes with gloo, driven by the stand-in graph backend.

Each scenario trains the same small model twice from the same state and data: once
through `capture_step` (with `harness.backend()`: the stand-in, or the recording
backend for `recording:NAME`) and once as a plain eager loop, and reports what the
tests compare.
"""

from __future__ import annotations

import warnings
from typing import Any

import harness
import torch
import torch.nn.functional as F
from torch import nn

import ddpgraph
from ddpgraph.ddp.distributed import DistInfo


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _batches(info: DistInfo, n: int, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + info.rank)
    return [
        (torch.randn(size, 16, generator=gen), torch.randint(0, 4, (size,), generator=gen))
        for _ in range(n)
    ]


def _setup(opt_cls: type[torch.optim.Optimizer] = torch.optim.AdamW, prepare=None, **opt_kw: Any):
    ddp = ddpgraph.prepare_ddp(_model())
    if prepare is not None:
        prepare(ddp)
    opt = opt_cls(
        ddp.parameters(), lr=opt_kw.pop("lr", 1e-2), **harness.optimizer_kwargs(opt_cls), **opt_kw
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    return ddp, opt, sched


def _step_fn(ddp: nn.Module, opt: torch.optim.Optimizer, hook=None):
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        if hook is not None:
            hook()
        opt.step()
        return loss.detach()

    return train_step


def _eager_reference(
    info: DistInfo, batches, opt_cls=torch.optim.AdamW, prepare=None, **opt_kw
) -> tuple[list[float], list[torch.Tensor]]:
    ddp, opt, sched = _setup(opt_cls, prepare, **opt_kw)
    # The captured run's optimizer is made graph-safe (on CPU: lr in a tensor); so is
    # the reference, so both do the same arithmetic.
    ddpgraph.graph_safe_optimizer(opt, tensor_lr_on_cpu=True)
    step = _step_fn(ddp, opt)
    losses = []
    for x, y in batches:
        losses.append(float(step(x, y)))
        sched.step()
    return losses, harness.params_of(ddp)


def _captured(
    info, batches, backend, opt_cls=torch.optim.AdamW, hook_factory=None, prepare=None, **kw
):
    ddp, opt, sched = _setup(opt_cls, prepare, **kw.pop("opt_kw", {}))
    hook = hook_factory(info, backend) if hook_factory else None
    step = ddpgraph.capture_step(
        _step_fn(ddp, opt, hook), model=ddp, optimizer=opt, backend=backend, **kw
    )
    losses, states = [], []
    for x, y in batches:
        losses.append(float(step(x, y)))
        states.append(step.state.value)
        sched.step()
    return step, losses, states, harness.params_of(ddp)


def _summary(step: ddpgraph.CapturedStep[Any]) -> dict[str, Any]:
    reason = step.reason
    where = reason.location if reason else None
    return {
        "state": step.state.value,
        "code": reason.code.value if reason else None,
        "line": [where.filename, where.lineno, where.source] if where else None,
        "ranks": list(reason.ranks) if reason else [],
        "reason": reason.format() if reason else None,
        "stats": vars(step.stats),
    }


def equivalence(info: DistInfo) -> dict[str, Any]:
    batches = _batches(info, 30)
    ref_losses, ref_params = _eager_reference(info, batches)
    step, losses, states, params = _captured(info, batches, harness.backend())
    step.close()
    return {
        **_summary(step),
        "states": states,
        "loss_rel_diff": harness.loss_rel_diff(ref_losses, losses),
        "param_rel_diff": harness.rel_diff(ref_params, params),
    }


def fail_one_rank(info: DistInfo) -> dict[str, Any]:
    """Capture fails on the last rank only: every rank must fall back together, and the
    failed capture must leave no trace in the training state."""
    batches = _batches(info, 20)
    ref_losses, ref_params = _eager_reference(info, batches)
    backend = harness.backend(fail_ranks={info.world_size - 1}, message="injected")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        step, losses, states, params = _captured(info, batches, backend)
    return {
        **_summary(step),
        "states": states,
        "loss_rel_diff": harness.loss_rel_diff(ref_losses, losses),
        "param_rel_diff": harness.rel_diff(ref_params, params),
    }


def fail_one_rank_raise(info: DistInfo) -> dict[str, Any]:
    batches = _batches(info, 14)
    backend = harness.backend(fail_ranks={info.world_size - 1})
    ddp, opt, _ = _setup()
    step = ddpgraph.capture_step(
        _step_fn(ddp, opt), model=ddp, optimizer=opt, backend=backend, on_failure="raise"
    )
    before = None
    for i, (x, y) in enumerate(batches):
        if i == 11:
            before = harness.params_of(ddp)
        try:
            step(x, y)
        except ddpgraph.DdpGraphError as err:
            after = harness.params_of(ddp)
            return {
                "raised_at": i,
                "code": err.code.value,
                "ranks": list(err.finding.ranks),
                "unchanged": harness.rel_diff(before, after) == 0.0,
            }
    return {"raised_at": None}


def schedule_inside_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """A hyper-parameter changed inside the step on one rank only: the probe finds it
    there, and all ranks refuse together."""
    batches = _batches(info, 16)

    def hook_factory(info, backend):
        holder = {}

        def hook():
            if info.rank == info.world_size - 1:
                holder["opt"].param_groups[0]["lr"].mul_(0.99)

        return hook, holder

    ddp, opt, sched = _setup()
    hook, holder = hook_factory(info, None)
    holder["opt"] = opt
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        step = ddpgraph.capture_step(
            _step_fn(ddp, opt, hook), model=ddp, optimizer=opt, backend=harness.backend()
        )
        for x, y in batches:
            step(x, y)
            sched.step()
    return _summary(step)


def refusal_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """An optimizer with no capturable mode on one rank: all ranks refuse at construction."""
    ddp = ddpgraph.prepare_ddp(_model())
    if info.rank == info.world_size - 1:
        opt: torch.optim.Optimizer = torch.optim.Adagrad(ddp.parameters(), lr=0.1)
    else:
        opt = torch.optim.Adam(ddp.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        step = ddpgraph.capture_step(
            _step_fn(ddp, opt), model=ddp, optimizer=opt, backend=harness.backend()
        )
    batches = _batches(info, 3)
    for x, y in batches:
        step(x, y)
    return _summary(step)


def input_change_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """After capture, one rank gets a smaller batch once: it runs that step eagerly (a
    local decision), the job does not hang, and training matches the eager loop."""
    batches = _batches(info, 20)
    if info.rank == info.world_size - 1:
        small = _batches(info, 1, size=5)[0]
        batches[15] = small
    ref_losses, ref_params = _eager_reference(info, batches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, losses, states, params = _captured(info, batches, harness.backend())
    return {
        **_summary(step),
        "states": states,
        "warnings": [
            str(w.message) for w in caught if issubclass(w.category, ddpgraph.DdpGraphWarning)
        ],
        "loss_rel_diff": harness.loss_rel_diff(ref_losses, losses),
        "param_rel_diff": harness.rel_diff(ref_params, params),
    }


def host_read_in_backward_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """A gradient hook that reads a value on the host, on the last rank only. Under the
    recording backend (as under CUDA) that rank's capture fails half-way through backward,
    with DDP's reducer holding some gradients marked ready: every rank falls back on the
    same call, the reducer is reset, and training equals the eager loop. The stand-in
    runs the hook for real and captures."""

    def prepare(ddp: nn.Module) -> None:
        if info.rank == info.world_size - 1:
            ddp.module[0].weight.register_hook(lambda g: g if float(g.abs().sum()) >= 0 else -g)

    batches = _batches(info, 16)
    ref_losses, ref_params = _eager_reference(info, batches, prepare=prepare)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        step, losses, states, params = _captured(info, batches, harness.backend(), prepare=prepare)
    return {
        **_summary(step),
        "states": states,
        "loss_rel_diff": harness.loss_rel_diff(ref_losses, losses),
        "param_rel_diff": harness.rel_diff(ref_params, params),
    }


def float_lr_after_capture(info: DistInfo) -> dict[str, Any]:
    """The recipe's silent error, without ddpgraph's tensor learning rate: a graph recorded
    with a float lr, then lr set to 0. Reports the size of the update before and after."""
    ddp, opt, _ = _setup(torch.optim.SGD, lr=0.05)
    x, y = _batches(info, 1)[0]
    step = _step_fn(ddp, opt)
    for _ in range(11):
        step(x, y)
    graph = harness.backend().capture(lambda: step(x, y), stream=None, pool=None)
    updates = []
    for lr in (0.05, 0.0):
        opt.param_groups[0]["lr"] = lr
        before = harness.params_of(ddp)
        graph.replay()
        updates.append(harness.rel_diff(before, harness.params_of(ddp)))
    graph.release()
    return {"update_at_lr": updates}


def no_backend_on_cpu(info: DistInfo) -> dict[str, Any]:
    ddp, opt, _ = _setup()
    step = ddpgraph.capture_step(_step_fn(ddp, opt), model=ddp, optimizer=opt, on_failure="raise")
    for x, y in _batches(info, 3):
        step(x, y)
    return _summary(step)


def submodule_switched(info: DistInfo) -> dict[str, Any]:
    """Every rank freezes a BatchNorm (`eval()`) three calls after capture and switches it
    back two calls later, then sets its momentum to another value and back two calls
    later: those calls run eagerly on every rank, the others replay, and training,
    statistics included, equals the eager run's."""

    def run(backend: Any) -> tuple[list[float], list[torch.Tensor], list[torch.Tensor], Any]:
        torch.manual_seed(0)
        ddp = ddpgraph.prepare_ddp(
            nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4))
        )
        opt = torch.optim.AdamW(
            ddp.parameters(), lr=1e-2, **harness.optimizer_kwargs(torch.optim.AdamW)
        )
        step: Any = _step_fn(ddp, opt)
        if backend is None:
            ddpgraph.graph_safe_optimizer(opt, tensor_lr_on_cpu=True)
        else:
            step = ddpgraph.capture_step(step, model=ddp, optimizer=opt, backend=backend)
        losses = []
        for i, (x, y) in enumerate(_batches(info, 20)):
            if i in (14, 16):
                ddp.module[1].train(i == 16)
            if i in (17, 19):
                ddp.module[1].momentum = 0.4 if i == 17 else 0.1
            losses.append(float(step(x, y)))
        return losses, harness.params_of(ddp), [b.clone() for b in ddp.buffers()], step

    ref_losses, ref_params, ref_buffers, _ = run(None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, params, buffers, step = run(harness.backend())
    step.close()
    return {
        **_summary(step),
        "warnings": [str(w.message) for w in caught if "_CHANGED]" in str(w.message)],
        "loss_rel_diff": harness.loss_rel_diff(ref_losses, losses),
        "param_rel_diff": harness.rel_diff(ref_params, params),
        "buffer_rel_diff": harness.rel_diff(ref_buffers, buffers),
    }


REGISTRY = {
    "equivalence": equivalence,
    "fail_one_rank": fail_one_rank,
    "fail_one_rank_raise": fail_one_rank_raise,
    "schedule_inside_on_one_rank": schedule_inside_on_one_rank,
    "refusal_on_one_rank": refusal_on_one_rank,
    "input_change_on_one_rank": input_change_on_one_rank,
    "no_backend_on_cpu": no_backend_on_cpu,
    "host_read_in_backward_on_one_rank": host_read_in_backward_on_one_rank,
    "float_lr_after_capture": float_lr_after_capture,
    "submodule_switched": submodule_switched,
}

if __name__ == "__main__":
    harness.run(REGISTRY)
