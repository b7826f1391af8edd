"""Gradient accumulation across calls with `ddp.no_sync()`, as users write it.

Each scenario trains a DDP model with a step that runs forward and `(loss / M).backward()`,
called under `with ddp.no_sync():` for M-1 of every M calls; the optimizer steps on the
M-th call, outside the step (after the call) or inside it (the step told by an argument,
or reading DDP's own flag). The same loop runs captured and eagerly; each rank reports
its per-call states, the finding, its parameters' distance to the eager run and to rank
0's parameters (gathered), so the tests can check that every rank refused together and
trained exactly as eager DDP does.

Scenario names: `outside_M<k>`, `argument_M<k>`, `flag_M<k>`, and `after_capture` (24
plain steps, captured, then accumulation over 4 calls).
"""

from __future__ import annotations

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

CALLS = 40
EVERY = 8  # `agree_every`: a change after capture is decided on soon


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _batches(info: DistInfo) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + info.rank)
    return [
        (torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen))
        for _ in range(CALLS)
    ]


def _loop(
    info: DistInfo, where: str, cycle: Callable[[int], int], captured: bool
) -> dict[str, Any]:
    ddp = ddpgraph.prepare_ddp(_model())
    opt = torch.optim.AdamW(
        ddp.parameters(), lr=1e-2, **harness.optimizer_kwargs(torch.optim.AdamW)
    )
    return accumulation_loop(
        info, ddp, opt, _batches(info), where, cycle, harness.backend(), captured=captured
    )


def accumulation_loop(
    info: DistInfo,
    ddp: Any,
    opt: torch.optim.Optimizer,
    batches: list[Any],
    where: str,
    cycle: Callable[[int], int],
    backend: Any,
    *,
    captured: bool = True,
) -> dict[str, Any]:
    """Train on `batches`, the step written `where` ("outside", "argument", "flag");
    `cycle(i)` is the M of call i (1: every call synchronises). Captured with `backend`
    (None: CUDA graphs), or, with `captured=False`, the eager reference. Also run on GPUs
    (tests/scenarios/gpu_capture_call.py)."""
    m = {"now": 1}

    def outside(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(ddp(x), y)
        (loss / m["now"]).backward()
        return loss.detach()

    def argument(x: torch.Tensor, y: torch.Tensor, last: bool) -> torch.Tensor:
        loss = F.cross_entropy(ddp(x), y)
        (loss / m["now"]).backward()
        if last:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    def flag(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(ddp(x), y)
        (loss / m["now"]).backward()
        if ddp.require_backward_grad_sync:  # not under no_sync: the cycle's last call
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    fn: Callable[..., torch.Tensor] = {"outside": outside, "argument": argument, "flag": flag}[
        where
    ]
    step: Any = fn
    if captured:
        step = ddpgraph.capture_step(
            fn, model=ddp, optimizer=opt, backend=backend, agree_every=EVERY
        )
    elif where != "outside":
        # The optimizer steps inside the step: the eager reference runs it as the
        # captured step's eager calls do (graph-safe mode installed around each call).
        step = harness.with_same_settings(opt, fn, info.device)
    states: list[str] = []
    losses: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (x, y) in enumerate(batches):
            m["now"] = cycle(i)
            last = (i + 1) % m["now"] == 0
            args = (x, y, last) if where == "argument" else (x, y)
            if last:
                losses.append(float(step(*args)))
            else:
                with ddp.no_sync():
                    losses.append(float(step(*args)))
            if last and where == "outside":
                opt.step()
                opt.zero_grad(set_to_none=True)
            states.append(step.state.value if captured else "eager")
    out: dict[str, Any] = {"losses": losses, "states": states, "params": harness.params_of(ddp)}
    if captured:
        reason = step.reason
        out.update(
            state=step.state.value,
            code=reason.code.value if reason else None,
            happened=reason.happened if reason else None,
            line=reason.location.source if reason and reason.location else None,
            stats=vars(step.stats),
        )
        step.close()
    return out


def _from_rank0(params: list[torch.Tensor]) -> float:
    """The largest difference between this rank's parameters and rank 0's."""
    flat = torch.cat([p.flatten() for p in params])
    mine = flat.clone()
    dist.broadcast(flat, src=0)
    return float((mine - flat).abs().max())


def _compare(info: DistInfo, where: str, cycle: Callable[[int], int]) -> dict[str, Any]:
    got = _loop(info, where, cycle, captured=True)
    ref = _loop(info, where, cycle, captured=False)
    params = got.pop("params")
    return {
        **got,
        "param_rel_diff": harness.rel_diff(ref["params"], params),
        "loss_rel_diff": harness.loss_rel_diff(ref["losses"], got["losses"]),
        "from_rank0": _from_rank0(params),
        "eager_from_rank0": _from_rank0(ref["params"]),
    }


def _scenario(where: str, m: int) -> Callable[[DistInfo], dict[str, Any]]:
    return lambda info: _compare(info, where, lambda i: m)


def after_capture(info: DistInfo) -> dict[str, Any]:
    """24 calls that each synchronise and step (captured at call 12), then M = 4."""
    return _compare(info, "argument", lambda i: 1 if i < 24 else 4)


REGISTRY = {
    f"{where}_M{m}": _scenario(where, m)
    for where in ("outside", "argument", "flag")
    for m in (2, 3, 4, 5)
}
REGISTRY["after_capture"] = after_capture
# A rank left waiting in a collective fails its scenario in 30 s (test_accumulation_gloo).
REGISTRY = harness.with_group_timeout(REGISTRY, 30)

if __name__ == "__main__":
    harness.run(REGISTRY)
