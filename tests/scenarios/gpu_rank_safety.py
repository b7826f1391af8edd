"""The capture engine's guards on real GPUs (NCCL, CUDA graphs), against eager training.

Run by tests/gpu/test_rank_safety_gpu.py under torchrun, one process per GPU (1 or 2).
On a machine without CUDA the same scenarios run with the stand-in backend, which is
how they are smoke-tested on CPU:

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/scenarios/gpu_rank_safety.py --out /tmp/out
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
from ddpgraph.ddp.build import built_on_stream, forward_counter
from ddpgraph.ddp.distributed import DistInfo
from ddpgraph.ddp.streams import on_stream
from ddpgraph.ddp.warmup import is_capturable_forward

Event = Callable[[int, nn.Module, torch.optim.Optimizer], None]


def _backend(info: DistInfo) -> Any:
    return None if info.device.type == "cuda" else ddpgraph.PassThroughBackend()


def _model(info: DistInfo) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10)).to(info.device)


def _batches(info: DistInfo, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7 + info.rank)
    out = []
    for _ in range(n):
        x = torch.randn(16, 64, generator=gen)
        out.append((x.to(info.device), x[:, :10].argmax(1).to(info.device)))
    return out


def _train(
    info: DistInfo, n: int, event: Event | None, captured: bool, **kw: Any
) -> dict[str, Any]:
    ddp = ddpgraph.prepare_ddp(
        _model(info), **({"device_ids": [info.device.index]} if info.device.type == "cuda" else {})
    )
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    step: Any = fn
    if captured:
        step = ddpgraph.capture_step(fn, model=ddp, optimizer=opt, backend=_backend(info), **kw)
    else:
        ddpgraph.graph_safe_optimizer(opt, tensor_lr_on_cpu=True)
    losses = []
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(_batches(info, n)):
            if event is not None:
                event(i, ddp, opt)
            losses.append(float(step(x, y)))
    out: dict[str, Any] = {"losses": losses, "params": harness.params_of(ddp)}
    if captured:
        out.update(
            state=step.state.value,
            stats=vars(step.stats),
            codes=[f.code.value for f in step.findings],
        )
        step.close()
    return out


def _compare(info: DistInfo, n: int, event: Event | None, **kw: Any) -> dict[str, Any]:
    got = _train(info, n, event, True, **kw)
    ref = _train(info, n, event, False)
    return {
        **{k: v for k, v in got.items() if k != "params"},
        "loss_rel_diff": harness.loss_rel_diff(ref["losses"], got["losses"]),
        "param_rel_diff": harness.rel_diff(ref["params"], got["params"]),
    }


def storage_moved_after_capture(info: DistInfo) -> dict[str, Any]:
    """`param.data = ...` after capture: a replay would write the freed storage."""

    def move(i: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        if i == 15:
            for p in model.parameters():
                p.data = p.data.clone()

    return _compare(info, 30, move, agree_every=8)


def optimizer_load_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """The last rank loads an optimizer checkpoint saved before any state existed."""
    saved: dict[str, Any] = {}

    def load(i: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        if i == 0:
            saved["sd"] = copy.deepcopy(opt.state_dict())
        if i == 15 and info.rank == info.world_size - 1:
            opt.load_state_dict(saved["sd"])

    return _compare(info, 40, load, agree_every=8)


def sampled_iteration_at_capture(info: DistInfo) -> dict[str, Any]:
    """Two DDP iterations outside the step, between the probe and the capture call, would
    make the capture record forward 100, which the reducer samples with a host sync."""
    ddp = ddpgraph.prepare_ddp(
        _model(info), **({"device_ids": [info.device.index]} if info.device.type == "cuda" else {})
    )
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    counter = forward_counter(ddp)
    assert counter is not None
    recorded: list[int] = []

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        capturing = info.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing or getattr(backend, "capturing", False):
            recorded.append(counter.count + 1)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    backend = _backend(info)
    step = ddpgraph.capture_step(fn, model=ddp, optimizer=opt, backend=backend, warmup_steps=97)
    data = _batches(info, 105)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for x, y in data[:97]:
            step(x, y)
        for x, y in data[:2]:
            with on_stream(built_on_stream(ddp)):
                F.cross_entropy(ddp(x), y).backward()
        for x, y in data[97:]:
            step(x, y)
    out = {
        "state": step.state.value,
        "recorded": recorded,
        "capturable": all(map(is_capturable_forward, recorded)),
        "codes": [f.code.value for f in step.findings],
        "stats": vars(step.stats),
    }
    step.close()
    return out


def input_written_by_step(info: DistInfo) -> dict[str, Any]:
    """The step counts its calls in an argument, in place."""
    ddp = ddpgraph.prepare_ddp(
        _model(info), **({"device_ids": [info.device.index]} if info.device.type == "cuda" else {})
    )
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    count = torch.zeros((), device=info.device)

    def fn(x: torch.Tensor, y: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        count.add_(1)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    step = ddpgraph.capture_step(fn, model=ddp, optimizer=opt, backend=_backend(info))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for x, y in _batches(info, 15):
            step(x, y, count)
    out = {
        "state": step.state.value,
        "count": float(count),
        "codes": [f.code.value for f in step.findings],
    }
    step.close()
    return out


REGISTRY = {
    "storage_moved_after_capture": storage_moved_after_capture,
    "optimizer_load_on_one_rank": optimizer_load_on_one_rank,
    "sampled_iteration_at_capture": sampled_iteration_at_capture,
    "input_written_by_step": input_written_by_step,
}

if __name__ == "__main__":
    harness.run(REGISTRY)
