"""Events on one rank only, on CPU processes with gloo and the stand-in backend.

Each scenario makes something happen on the last rank only (a checkpoint loaded, a
changed batch, a wrong argument, a hyper-parameter changed, optimizer state cleared) and
reports what every rank ended in, with the losses of the same run trained eagerly, so
the tests can check that all ranks took the same path on the same call, in bounded time
(the process group's timeout is short: a rank left waiting fails the scenario), and
that training equals eager training.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import harness
import torch
import torch.nn.functional as F
from torch import nn

import ddpgraph
from ddpgraph.distributed import DistInfo

EVERY = 8  # `agree_every` of the captured runs: decisions come soon after an event
Event = Callable[[int, nn.Module, torch.optim.Optimizer], None]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _batches(info: DistInfo, n: int, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + info.rank)
    return [(torch.randn(size, 16, generator=gen), torch.randint(0, 4, (size,), generator=gen)) for _ in range(n)]


def _train_fn(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return train_step


def _run(info: DistInfo, batches: list[Any], event: Event | None, captured: bool, **kw: Any) -> dict[str, Any]:
    """Train DDP on `batches`, calling `event(i, model, opt)` before call i; captured or
    eager (with the same graph-safe optimizer). Stops at a `DdpGraphError`."""
    ddp = ddpgraph.prepare_ddp(_model())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    fn = _train_fn(ddp, opt)
    step: Any = fn
    if captured:
        step = ddpgraph.capture_step(fn, model=ddp, optimizer=opt, backend=ddpgraph.PassThroughBackend(), agree_every=EVERY, **kw)
    else:
        ddpgraph.graph_safe_optimizer(opt, tensor_lr_on_cpu=True)
    losses: list[float] = []
    states: list[str] = []
    raised: dict[str, Any] = {}
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(batches):
            if event is not None:
                event(i, ddp, opt)
            try:
                losses.append(float(step(x, y)))
            except ddpgraph.DdpGraphError as err:
                raised = {"raised_at": i, "raised_code": err.code.value, "raised_ranks": list(err.finding.ranks)}
                break
            states.append(step.state.value if captured else "eager")
    out: dict[str, Any] = {"losses": losses, "states": states, "params": harness.params_of(ddp), **raised}
    if captured:
        out.update(state=step.state.value, stats=vars(step.stats), code=step.reason.code.value if step.reason else None)
        step.close()
    return out


def _compare(info: DistInfo, batches: list[Any], event: Event | None, **kw: Any) -> dict[str, Any]:
    got = _run(info, batches, event, True, **kw)
    # The eager reference trains exactly the calls the captured run completed.
    ref = _run(info, batches[: len(got["losses"])], event, False)
    params = got.pop("params")
    return {
        **got,
        "loss_rel_diff": harness.loss_rel_diff(ref["losses"], got["losses"]),
        "param_rel_diff": harness.rel_diff(ref.pop("params"), params),
    }


def _on_last(info: DistInfo, at: int, action: Callable[[nn.Module, torch.optim.Optimizer], None]) -> Event:
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
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fn = _train_fn(model, opt)
        step: Any = fn
        if captured:
            step = ddpgraph.capture_step(fn, model=model, optimizer=opt, backend=ddpgraph.PassThroughBackend())
        else:
            ddpgraph.graph_safe_optimizer(opt, tensor_lr_on_cpu=True)
        losses = [float(step(x, y)) for x, y in _batches(info, 12)]
        results.append((losses, getattr(step, "state", None)))
    (losses, state), (ref, _) = results
    return {"built": True, "state": state.value, "loss_rel_diff": harness.loss_rel_diff(ref, losses)}


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
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    warmup = 5 if info.rank == info.world_size - 1 else None
    try:
        ddpgraph.capture_step(_train_fn(ddp, opt), model=ddp, optimizer=opt, backend=ddpgraph.PassThroughBackend(), warmup_steps=warmup)
    except ddpgraph.DdpGraphUsageError as err:
        return {"raised": True, "code": err.code.value, "ranks": list(err.finding.ranks), "lr_is_float": isinstance(opt.param_groups[0]["lr"], float)}
    return {"raised": False}


def warmup_differs_by_rank(info: DistInfo) -> dict[str, Any]:
    """Each rank asks for another warm-up: all capture on the same call, the longest."""
    return _compare(info, _batches(info, 20), None, warmup_steps=11 + info.rank)


def hyperparameter_raise_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """`on_failure="raise"`; after capture the last rank changes a Python hyper-parameter."""
    return _compare(info, _batches(info, 40), _on_last(info, 14, _set_weight_decay), on_failure="raise")


def hyperparameter_eager_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """The same with `on_failure="eager"`: every rank ends eager, on the same call."""
    return _compare(info, _batches(info, 40), _on_last(info, 14, _set_weight_decay))


def state_cleared_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """After capture, the last rank clears its optimizer state by hand."""
    return _compare(info, _batches(info, 40), _on_last(info, 14, lambda m, o: o.state.clear()))


def _set_weight_decay(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.param_groups[0]["weight_decay"] = 0.5


REGISTRY = {
    "plain_module_on_one_rank": plain_module_on_one_rank,
    "optimizer_load_on_one_rank": optimizer_load_on_one_rank,
    "input_raise_on_one_rank": input_raise_on_one_rank,
    "usage_error_on_one_rank": usage_error_on_one_rank,
    "warmup_differs_by_rank": warmup_differs_by_rank,
    "hyperparameter_raise_on_one_rank": hyperparameter_raise_on_one_rank,
    "hyperparameter_eager_on_one_rank": hyperparameter_eager_on_one_rank,
    "state_cleared_on_one_rank": state_cleared_on_one_rank,
}

if __name__ == "__main__":
    harness.run(REGISTRY)
