"""Adopting a DDP model built with `DDP(...)`: CPU processes with gloo.

Each scenario builds the same model twice, wraps both in plain `DDP(...)` with the same
arguments, adopts one (`adopt_ddp`, the reducer rebuild that PyTorch without the override
switch needs) and trains both with the same optimizer on the same data. With 2 ranks the
all-reduce sum is exact whatever the bucket layout, so the runs must agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import harness
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpgraph.ddp.adopt import adopt_ddp, rebuild_reducer
from ddpgraph.ddp.build import forward_counter
from ddpgraph.ddp.distributed import DistInfo


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 4)
        self.unused = nn.Linear(4, 4)  # never in the forward: find_unused_parameters matters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


SETTINGS: dict[str, dict[str, Any]] = {
    "default": {"find_unused_parameters": True},
    "small_buckets": {"bucket_cap_mb": 0.01, "find_unused_parameters": True},
    "bucket_view": {"gradient_as_bucket_view": True, "find_unused_parameters": True},
    "static_graph": {"static_graph": True},
    "no_broadcast": {"broadcast_buffers": False, "find_unused_parameters": True},
}


def _batches(info: DistInfo, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7 + info.rank)
    return [
        (torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen))
        for _ in range(n)
    ]


def _build(
    kwargs: dict[str, Any], prepare: Callable[[nn.Module], None] | None = None
) -> tuple[DDP, torch.optim.Optimizer]:
    net = Net()
    if prepare is not None:
        prepare(net)
    ddp = DDP(net, **kwargs)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2)


def _train(ddp: DDP, opt: torch.optim.Optimizer, batches: list[Any]) -> list[float]:
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _settings(ddp: DDP) -> dict[str, Any]:
    data = ddp._get_ddp_logging_data()
    keys = (
        "bucket_cap_bytes",
        "find_unused_parameters",
        "gradient_as_bucket_view",
        "static_graph",
        "broadcast_buffers",
        "comm_hook",
    )
    return {
        "logged": {k: data.get(k) for k in keys},
        "attrs": {
            "bucket_bytes_cap": ddp.bucket_bytes_cap,
            "find_unused_parameters": ddp.find_unused_parameters,
            "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
            "static_graph": ddp.static_graph,
            "broadcast_buffers": ddp.broadcast_buffers,
            "ignored": sorted(ddp.parameters_to_ignore),
            "hooks": [getattr(h, "__qualname__", str(h)) for h, _ in ddp._comm_hooks],
        },
    }


def _compare(
    info: DistInfo,
    kwargs: dict[str, Any],
    *,
    before: int,
    after: int = 12,
    prepare: Callable[[nn.Module], None] | None = None,
    hook: Callable[[DDP], None] | None = None,
) -> dict[str, Any]:
    """Train `before` steps, adopt one of the two models, train `after` more."""
    batches = _batches(info, before + after)
    runs = []
    for adopt in (False, True):
        ddp, opt = _build(kwargs, prepare)
        if hook is not None:
            hook(ddp)
        losses = _train(ddp, opt, batches[:before])
        settings_before = _settings(ddp)
        reducer_before = id(ddp.reducer)
        refusal = adopt_ddp(ddp, None, method="rebuild") if adopt else None
        runs.append(
            {
                "losses": losses + _train(ddp, opt, batches[before:]),
                "params": harness.params_of(ddp),
                "refusal": refusal.format() if refusal else None,
                "same_settings": _settings(ddp) == settings_before,
                "settings": _settings(ddp),
                "new_reducer": id(ddp.reducer) != reducer_before,
                "counter": forward_counter(ddp).count,  # type: ignore[union-attr]
            }
        )
    plain, adopted = runs
    return {
        "param_rel_diff": harness.rel_diff(plain["params"], adopted["params"]),
        "bitwise": all(
            torch.equal(a, b) for a, b in zip(plain["params"], adopted["params"], strict=True)
        ),
        "loss_rel_diff": harness.loss_rel_diff(plain["losses"], adopted["losses"]),
        "refusal": adopted["refusal"],
        "same_settings": adopted["same_settings"],
        "settings": adopted["settings"],
        "new_reducer": adopted["new_reducer"],
        "counter": adopted["counter"],
    }


def _scenario(name: str) -> harness.Scenario:
    return lambda info: _compare(info, SETTINGS[name], before=3)


def fresh(info: DistInfo) -> dict[str, Any]:
    """Adopted before the first step, as `capture_step` normally does."""
    return _compare(info, SETTINGS["default"], before=0)


def python_comm_hook(info: DistInfo) -> dict[str, Any]:
    return _compare(
        info,
        SETTINGS["default"],
        before=2,
        hook=lambda d: d.register_comm_hook(None, default_hooks.allreduce_hook),
    )


def ignored_params(info: DistInfo) -> dict[str, Any]:
    def ignore(net: nn.Module) -> None:
        DDP._set_params_and_buffers_to_ignore_for_model(net, ["b.weight", "b.bias"])

    return _compare(info, SETTINGS["default"], before=2, prepare=ignore)


def nodes_are_new(info: DistInfo) -> dict[str, Any]:
    """The tag written into the old accumulators is absent from the new ones."""
    ddp, opt = _build(SETTINGS["default"])
    _train(ddp, opt, _batches(info, 2))
    params = list(ddp.parameters())
    for p in params:
        p.expand_as(p).grad_fn.next_functions[0][0].metadata["old"] = True
    stale = rebuild_reducer(ddp, None)
    tagged = sum("old" in p.expand_as(p).grad_fn.next_functions[0][0].metadata for p in params)
    return {"stale": stale, "still_old": tagged, "params": len(params)}


def stale_graph_refused(info: DistInfo) -> dict[str, Any]:
    """A loss kept from an earlier step holds the old accumulators (on rank 1 only):
    every rank refuses, and training goes on as before."""
    ddp, opt = _build(SETTINGS["default"])
    ref, ref_opt = _build(SETTINGS["default"])
    batches = _batches(info, 6)
    x, y = batches[0]
    opt.zero_grad()
    kept = F.cross_entropy(ddp(x), y)
    kept.backward()
    opt.step()
    _train(ref, ref_opt, batches[:1])
    if info.rank != 1:
        del kept
    refusal = adopt_ddp(ddp, None, method="rebuild")
    _train(ddp, opt, batches[1:])
    _train(ref, ref_opt, batches[1:])
    return {
        "code": refusal.code.value if refusal else None,
        "reason": refusal.format() if refusal else None,
        "param_rel_diff": harness.rel_diff(harness.params_of(ddp), harness.params_of(ref)),
    }


def builtin_hook_refused(info: DistInfo) -> dict[str, Any]:
    ddp, _ = _build(SETTINGS["default"])
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    reducer = id(ddp.reducer)
    refusal = adopt_ddp(ddp, None, method="rebuild")
    return {
        "code": refusal.code.value if refusal else None,
        "reason": refusal.format() if refusal else None,
        "untouched": id(ddp.reducer) == reducer,
    }


def override_switch(info: DistInfo) -> dict[str, Any]:
    """Where PyTorch has the override switch, `auto` turns it on and leaves the reducer."""
    ddp, _ = _build(SETTINGS["default"])
    reducer = id(ddp.reducer)
    has = hasattr(torch.autograd.graph, "set_override_stale_capture_stream")
    refusal = adopt_ddp(ddp, None)
    state = bool(torch._C._override_stale_capture_stream()) if has else None
    if has:
        torch.autograd.graph.set_override_stale_capture_stream(False)
    return {
        "has": has,
        "refusal": refusal is not None,
        "switch_on": state,
        "same_reducer": id(ddp.reducer) == reducer,
    }


REGISTRY: dict[str, harness.Scenario] = {
    **{name: _scenario(name) for name in SETTINGS},
    "fresh": fresh,
    "python_comm_hook": python_comm_hook,
    "ignored_params": ignored_params,
    "nodes_are_new": nodes_are_new,
    "stale_graph_refused": stale_graph_refused,
    "builtin_hook_refused": builtin_hook_refused,
    "override_switch": override_switch,
}

if __name__ == "__main__":
    harness.run(REGISTRY)
