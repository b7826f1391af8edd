"""`capture_step` on a DDP the user built with `DDP(...)` on the default stream, on GPUs.

Each scenario builds the same model twice on the default stream, with the same DDP
arguments: one is trained through `capture_step` (which adopts it), the other eagerly on
the default stream with the same graph-safe optimizer. Run by tests/gpu/test_adopt_gpu.py.
"""

from __future__ import annotations

from typing import Any

import harness
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpgraph
from ddpgraph.app.models import MLP
from ddpgraph.ddp.distributed import DistInfo

STEPS = 45


def _model(info: DistInfo) -> nn.Module:
    torch.manual_seed(0)
    return MLP(dim=64, hidden=128, depth=2).to(info.device)


def _batches(info: DistInfo) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11 + info.rank)
    out = []
    for _ in range(STEPS):
        x = torch.randn(16, 64, generator=gen)
        out.append((x.to(info.device), x[:, :10].argmax(1).to(info.device)))
    return out


def _setup(info: DistInfo, ddp_kwargs: dict[str, Any]):
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    ddp = DDP(_model(info), device_ids=device_ids, **ddp_kwargs)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return ddp, opt, sched, train_step


def _compare(
    info: DistInfo, before: int = 0, keep_loss: bool = False, **ddp_kwargs: Any
) -> dict[str, Any]:
    """`before` eager steps on the default stream first, then `capture_step`; with
    `keep_loss` the last of them stays referenced, holding the old accumulators."""
    batches = _batches(info)
    ref, ref_opt, ref_sched, ref_step = _setup(info, ddp_kwargs)
    ref_losses = []
    same = harness.with_same_settings(ref_opt, ref_step, info.device)
    for i, (x, y) in enumerate(batches):
        # From where capture_step takes over: its eager steps run with graph-safe mode.
        ref_losses.append(float((same if i >= before else ref_step)(x, y)))
        ref_sched.step()

    ddp, opt, sched, train_step = _setup(info, ddp_kwargs)
    losses, states = [], []
    kept = None
    for x, y in batches[:before]:
        opt.zero_grad(set_to_none=True)
        kept = F.cross_entropy(ddp(x), y)
        kept.backward()
        opt.step()
        losses.append(float(kept.detach()))
        sched.step()
    if not keep_loss:
        del kept
    batches = batches[before:]
    with ddpgraph.capture_step(train_step, model=ddp, optimizer=opt) as step:
        for x, y in batches:
            losses.append(float(step(x, y)))
            states.append(step.state.value)
            sched.step()
        reason = step.reason
        stats = vars(step.stats)
    params, ref_params = harness.params_of(ddp), harness.params_of(ref)
    return {
        "states": states,
        "code": reason.code.value if reason else None,
        "reason": reason.format() if reason else None,
        "stats": stats,
        "loss_rel_diff": harness.loss_rel_diff(ref_losses, losses),
        "param_rel_diff": harness.rel_diff(ref_params, params),
        "bitwise_equal": all(torch.equal(a, b) for a, b in zip(ref_params, params, strict=True)),
        "override_switch": hasattr(torch.autograd.graph, "set_override_stale_capture_stream"),
    }


def mixed_precision_rebuilt(info: DistInfo) -> dict[str, Any]:
    """DDP's own mixed precision (CUDA only: it copies on a side stream with events):
    adoption is refused, and the model trains on exactly as the one never offered."""
    from torch.nn.parallel.distributed import _MixedPrecision

    from ddpgraph.ddp.adopt import adopt_ddp

    mixed = _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    runs, refusal = [], None
    # Never offered, offered and refused, never offered again: the last says how exactly
    # DDP's mixed precision repeats itself, the bound of the check on the second.
    for adopt in (False, True, False):
        ddp, _, _, train_step = _setup(info, {"mixed_precision": mixed})
        for i, (x, y) in enumerate(_batches(info)):
            if adopt and i == 3:
                found = adopt_ddp(ddp, torch.cuda.Stream(), method="rebuild")
                refusal = found.format() if found else None
            train_step(x, y)
        torch.cuda.synchronize()
        runs.append(harness.params_of(ddp))
    return {
        "refusal": refusal,
        "bitwise_equal": all(torch.equal(a, b) for a, b in zip(runs[0], runs[1], strict=True)),
        "param_rel_diff": harness.rel_diff(runs[0], runs[1]),
        "repeats_bitwise": all(torch.equal(a, b) for a, b in zip(runs[0], runs[2], strict=True)),
        "repeat_rel_diff": harness.rel_diff(runs[0], runs[2]),
    }


REGISTRY: dict[str, harness.Scenario] = {
    "mixed_precision_rebuilt": mixed_precision_rebuilt,
    "plain": lambda info: _compare(info),
    "find_unused": lambda info: _compare(info, find_unused_parameters=True),
    "bucket_view": lambda info: _compare(info, gradient_as_bucket_view=True),
    "static_graph": lambda info: _compare(info, static_graph=True),
    "small_buckets": lambda info: _compare(info, bucket_cap_mb=0.05),
    "trained_before": lambda info: _compare(info, before=20),
    "kept_loss": lambda info: _compare(info, before=3, keep_loss=True),
}

if __name__ == "__main__":
    harness.run(REGISTRY)
