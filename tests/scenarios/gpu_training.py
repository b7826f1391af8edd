"""A real training loop inside a captured step, on GPUs with NCCL, against the same loop run
eagerly: fp16 loss scaling with injected overflows, gradient accumulation, clipping,
non-finite loss detection, random numbers, checkpoints and evaluation between steps.

Every scenario trains from the same state and data twice (plain DDP on the default stream
with the same graph-safe optimizer; `capture_step`) and compares step by step. Run by
tests/gpu/test_training_gpu.py under torchrun with one process per GPU.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable
from typing import Any

import harness
import torch
import torch.nn.functional as F
from cpu_training import (
    Poison,
    Trajectory,
    batches,
    compare,
    net,
    run_watched,
    saved,
    summary,
    watched_step,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpgraph
from ddpgraph.app.models import GPTConfig, SmallResNet, gpt_workload
from ddpgraph.ddp.distributed import DistInfo
from ddpgraph.training.accumulate import accumulate
from ddpgraph.training.checkpoint import load_training_state, training_state
from ddpgraph.training.monitor import NonFiniteMonitor
from ddpgraph.training.scaler import GraphSafeGradScaler

SHAPE = {"dim": 64, "hidden": 256, "classes": 10}
STEPS = 30


def _wrap(model: nn.Module, info: DistInfo, captured: bool) -> DDP:
    if captured:
        return ddpgraph.prepare_ddp(model, device_ids=[info.device.index])
    return DDP(model, device_ids=[info.device.index])


def _step_or_eager(
    fn: Callable[..., Any], ddp: DDP, opt: torch.optim.Optimizer, captured: bool, **kw: Any
) -> Any:
    """The captured step, or `fn` itself with the optimizer made graph-safe as capture does."""
    if captured:
        return ddpgraph.capture_step(fn, model=ddp, optimizer=opt, **kw)
    ddpgraph.graph_safe_optimizer(opt)
    return fn


def _close(step: Any) -> dict[str, Any]:
    if not isinstance(step, ddpgraph.CapturedStep):
        return {}
    out = summary(step)
    step.close()
    return out


# ------------------------------------------------------------------ 1. fp16 loss scaling
# Calls of the poisoned gradient hook (one per micro-batch backward). Steps 0-10 warm up,
# step 11 is recorded and replayed, later steps are replays: 5 is eager, 14 and 15 are
# consecutive replays, 23 a replay after the scale grew again.
POISONED_STEPS = (5, 14, 15, 23)


def _scaled_run(
    info: DistInfo, *, captured: bool, fused: bool, clip: bool, micro: int
) -> tuple[Trajectory, dict[str, Any]]:
    model = net(info, **SHAPE)
    # On the last rank only, micro-batch 0 of each poisoned step: before DDP's all-reduce.
    Poison(model, info, [s * micro for s in POISONED_STEPS], [info.world_size - 1]).grad_hook(
        model.fc1.weight
    )
    ddp = _wrap(model, info, captured)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01, fused=fused)
    schedule = {"init_scale": 2.0**14, "growth_interval": 4}
    scaler: Any = (
        GraphSafeGradScaler(**schedule) if captured else torch.amp.GradScaler("cuda", **schedule)
    )

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.float16):
            return F.cross_entropy(ddp(x), y)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        loss = accumulate(ddp, (x, y), loss_fn, micro_batches=micro, scaler=scaler)
        if clip:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        else:
            norm = torch.zeros((), device=x.device)
        scaler.step(opt)
        scaler.update()
        return loss, norm

    step = _step_or_eager(
        train_step, ddp, opt, captured, **({"scaler": scaler} if captured else {})
    )
    trace = Trajectory()
    for x, y in batches(info, STEPS, size=32, dim=SHAPE["dim"], classes=SHAPE["classes"]):
        loss, norm = step(x, y)
        trace.add(loss, ddp, opt, scale=scaler.get_scale(), norm=float(norm))
    extra = {"skipped": scaler.read().skipped_steps} if captured else {}
    return trace, {**_close(step), **extra}


def _unchanged(trace: Trajectory, n_params: int, step: int) -> bool:
    before, after = trace.params[step - 1][:n_params], trace.params[step][:n_params]
    return all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def scaler(info: DistInfo) -> dict[str, Any]:
    """GraphSafeGradScaler captured against torch.amp.GradScaler eagerly, with an inf
    gradient on the last rank only at POISONED_STEPS: fused AdamW (the kernel skips), the
    default AdamW with unscale_ and clipping (restored from a copy), and two micro-batches
    with the inf in the one under `no_sync`."""
    n_params = len(list(net(info, **SHAPE).parameters()))
    variants = {
        "fused": {"fused": True, "clip": False, "micro": 1},
        "capturable_clip": {"fused": False, "clip": True, "micro": 1},
        "no_sync": {"fused": True, "clip": True, "micro": 2},
    }
    out: dict[str, Any] = {}
    for name, kw in variants.items():
        ref, _ = _scaled_run(info, captured=False, **kw)
        run, info_step = _scaled_run(info, captured=True, **kw)
        out[name] = {
            **compare(ref, run),
            **info_step,
            "scales": run.values["scale"],
            "ref_scales": ref.values["scale"],
            "norms": run.values["norm"],
            "skipped_unchanged": [_unchanged(run, n_params, s) for s in POISONED_STEPS],
            "ref_skipped_unchanged": [_unchanged(ref, n_params, s) for s in POISONED_STEPS],
            "param_sum": sum(float(p.sum()) for p in run.params[-1][:n_params]),
        }
    return out


# ------------------------------------------------------------------ 2. accumulation, bf16
def accumulation(info: DistInfo) -> dict[str, Any]:
    """A small GPT, bf16 autocast, AdamW, cosine LR and clipping, 4 micro-batches per step
    (one batch split, or a list of micro-batches), eager against captured."""
    cfg = GPTConfig(vocab=256, block=64, layers=2, dim=128, heads=4)
    workload = gpt_workload(cfg)
    gen = torch.Generator().manual_seed(11 + info.rank)
    data = [workload.make_batch(16, gen, info.device) for _ in range(24)]

    def run(captured: bool, as_list: bool) -> tuple[Trajectory, dict[str, Any]]:
        torch.manual_seed(0)
        ddp = _wrap(workload.build().to(info.device), info, captured)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / 24))
        )

        def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return workload.loss(ddp(x), y)

        def train_step(x: Any, y: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
            opt.zero_grad(set_to_none=True)
            loss = (
                accumulate(ddp, x, loss_fn)
                if as_list
                else accumulate(ddp, (x, y), loss_fn, micro_batches=4)
            )
            norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            return loss, norm

        step = _step_or_eager(train_step, ddp, opt, captured)
        trace = Trajectory()
        for x, y in data:
            args = (
                ([(a, b) for a, b in zip(x.chunk(4), y.chunk(4), strict=True)],)
                if as_list
                else (x, y)
            )
            loss, norm = step(*args)
            trace.add(loss, ddp, opt, norm=float(norm))
            sched.step()
        return trace, _close(step)

    out: dict[str, Any] = {}
    for as_list in (False, True):
        ref, _ = run(False, as_list)
        trace, info_step = run(True, as_list)
        out["list" if as_list else "split"] = {**compare(ref, trace), **info_step}
    return out


# ------------------------------------------------------------------ 3. non-finite loss
def monitor(info: DistInfo) -> dict[str, Any]:
    """A NaN loss on the last rank only at step 15 (a replay): every rank raises after
    step 16, naming step 15 and that rank; the values logged before are the eager run's."""

    def run(captured: bool) -> dict[str, Any]:
        model = net(info, **SHAPE)
        poison = Poison(model, info, [15], [info.world_size - 1], value=math.nan)
        ddp = _wrap(model, info, captured)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        watch = NonFiniteMonitor(action="raise")
        step = _step_or_eager(watched_step(ddp, opt, poison, watch), ddp, opt, captured)
        data = batches(info, 20, size=32, dim=SHAPE["dim"], classes=SHAPE["classes"])
        return {**run_watched(step, watch, data), **_close(step)}

    ref = run(False)
    out = run(True)
    losses = [[v["loss"] for v in r["logged"]] for r in (ref, out)]
    return {
        **out,
        "ref_raised_at": ref["raised_at"],
        "logged_rel_diff": harness.loss_rel_diff(*losses),
    }


# ------------------------------------------------------------------ 4. random numbers
def _random_run(
    info: DistInfo, *, captured: bool, generator: str, seed: int
) -> tuple[Trajectory, list[torch.Tensor], dict[str, Any]]:
    """Dropout (default CUDA generator) in the model, and with `generator` "user" or
    "unregistered" also input noise from a `torch.Generator(device=...)`. Each step returns
    a fresh dropout mask and, with a generator, a fresh draw from it."""
    model = net(info, **SHAPE, dropout=0.5)
    ddp = _wrap(model, info, captured)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    noise = torch.Generator(device=info.device)
    noise.manual_seed(seed + 1000 + info.rank)
    probe = torch.ones(512, device=info.device)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        draws = [F.dropout(probe, 0.5, training=True)]
        if generator != "default":
            eps = torch.randn(x.shape, device=x.device, generator=noise)
            x = x + 0.1 * eps
            draws.append(eps.flatten()[:512])
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.detach(), torch.cat(draws)

    kw = {"generators": [noise]} if generator == "user" else {}
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        step = _step_or_eager(train_step, ddp, opt, captured, **kw)
        torch.manual_seed(seed + info.rank)
        trace, draws = Trajectory(), []
        for x, y in batches(info, 20, size=32, dim=SHAPE["dim"], classes=SHAPE["classes"]):
            loss, draw = step(x, y)
            trace.add(loss, ddp, opt)
            draws.append(draw.detach().clone())
    return trace, draws, _close(step)


def random_numbers(info: DistInfo) -> dict[str, Any]:
    """Replays draw fresh numbers; two captured runs from one seed are identical; a
    captured run and an eager run from one seed draw the same numbers (measured)."""
    out: dict[str, Any] = {}
    for generator in ("default", "user", "unregistered"):
        ref, ref_draws, _ = _random_run(info, captured=False, generator=generator, seed=1)
        first, draws, info_step = _random_run(info, captured=True, generator=generator, seed=1)
        second, draws2, _ = _random_run(info, captured=True, generator=generator, seed=1)
        replayed = draws[11:]  # step 11 is recorded, then replayed at once
        out[generator] = {
            **compare(ref, first),
            **info_step,
            "replay_draws_all_differ": all(
                not torch.equal(a, b) for a, b in itertools.pairwise(replayed)
            ),
            "draws_equal_eager": all(
                torch.equal(a, b) for a, b in zip(ref_draws, draws, strict=True)
            ),
            "first_draw_diff_step": next(
                (
                    i
                    for i, (a, b) in enumerate(zip(ref_draws, draws, strict=True))
                    if not torch.equal(a, b)
                ),
                None,
            ),
            "rerun_identical": compare(first, second)["bitwise"]
            and all(torch.equal(a, b) for a, b in zip(draws, draws2, strict=True)),
            "keep_fraction": float(torch.stack([d[:512] for d in draws]).mean() / 2.0),
        }
    return out


# ------------------------------------------------------------------ 5. checkpoints
def checkpoint(info: DistInfo) -> dict[str, Any]:
    """fp16 with the scaler, dropout, AdamW(fused) and a schedule. A checkpoint saved at
    step 17 (replays) is loaded into the live graph at step 24, and into new objects that
    warm up and capture again: both then train steps 17-29 as the run that never stopped."""
    data = batches(info, STEPS, size=32, dim=SHAPE["dim"], classes=SHAPE["classes"])

    def build(captured: bool, seed: int) -> dict[str, Any]:
        ddp = _wrap(net(info, **SHAPE, dropout=0.1), info, captured)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.95**s)
        scaler = GraphSafeGradScaler(init_scale=2.0**14, growth_interval=3)

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(ddp(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss.detach()

        step = _step_or_eager(
            train_step, ddp, opt, captured, **({"scaler": scaler} if captured else {})
        )
        torch.manual_seed(seed + info.rank)
        return {"ddp": ddp, "opt": opt, "sched": sched, "scaler": scaler, "step": step}

    def train(objs: dict[str, Any], part: list[Any]) -> Trajectory:
        trace = Trajectory()
        for x, y in part:
            trace.add(
                objs["step"](x, y), objs["ddp"], objs["opt"], scale=objs["scaler"].get_scale()
            )
            objs["sched"].step()
        return trace

    def state(objs: dict[str, Any]) -> dict[str, Any]:
        return saved(
            training_state(
                model=objs["ddp"],
                optimizer=objs["opt"],
                scheduler=objs["sched"],
                scaler=objs["scaler"],
            )
        )

    def load(objs: dict[str, Any], ckpt: dict[str, Any]) -> None:
        load_training_state(
            ckpt,
            model=objs["ddp"],
            optimizer=objs["opt"],
            scheduler=objs["sched"],
            scaler=objs["scaler"],
        )

    eager = build(False, 1)
    eager_trace = train(eager, data)
    straight = build(True, 1)
    head = train(straight, data[:17])
    tail = train(straight, data[17:])
    straight_info = _close(straight["step"])

    live = build(True, 1)
    train(live, data[:17])
    ckpt = state(live)
    train(live, data[17:24])
    load(live, ckpt)
    live_tail = train(live, data[17:])
    live_info = _close(live["step"])

    resumed = build(True, 7)  # another seed: the checkpoint must set the generators
    load(resumed, ckpt)
    resumed_tail = train(resumed, data[17:])
    resumed_info = _close(resumed["step"])

    whole = Trajectory(
        head.losses + tail.losses,
        head.params + tail.params,
        head.states + tail.states,
        {k: head.values[k] + tail.values[k] for k in head.values},
    )
    return {
        "vs_eager": {**compare(eager_trace, whole), **straight_info},
        "live_load": {**compare(tail, live_tail), **live_info},
        "resumed": {**compare(tail, resumed_tail), **resumed_info},
        "scales": tail.values["scale"],
    }


# ------------------------------------------------------------------ 6. evaluation
def evaluation(info: DistInfo) -> dict[str, Any]:
    """A small ResNet with BatchNorm (buffers broadcast by DDP), eval passes under
    `no_grad` every 4 steps, through DDP or through the module: training, eval losses and
    running statistics equal the eager loop's on every rank."""
    gen = torch.Generator().manual_seed(5 + info.rank)
    data = [
        (
            torch.randn(8, 3, 16, 16, generator=gen).to(info.device),
            torch.randint(0, 10, (8,), generator=gen).to(info.device),
        )
        for _ in range(24)
    ]
    held_out = [
        (
            torch.randn(8, 3, 16, 16, generator=gen).to(info.device),
            torch.randint(0, 10, (8,), generator=gen).to(info.device),
        )
        for _ in range(2)
    ]

    def run(captured: bool, through_ddp: bool) -> tuple[Trajectory, list[float], dict[str, Any]]:
        torch.manual_seed(0)
        ddp = _wrap(SmallResNet(classes=10, width=8).to(info.device), info, captured)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        step = _step_or_eager(train_step, ddp, opt, captured)
        evaluate = ddp if through_ddp else ddp.module
        trace, evals = Trajectory(), []
        for i, (x, y) in enumerate(data):
            trace.add(step(x, y), ddp, opt)
            if i % 4 == 2:
                ddp.eval()
                with torch.no_grad():
                    evals.extend(float(F.cross_entropy(evaluate(hx), hy)) for hx, hy in held_out)
                ddp.train()
        return trace, evals, _close(step)

    deterministic = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True  # conv backward may use atomics otherwise
    try:
        out: dict[str, Any] = {}
        for through_ddp in (True, False):
            ref, ref_evals, _ = run(False, through_ddp)
            trace, evals, info_step = run(True, through_ddp)
            out["ddp" if through_ddp else "module"] = {
                **compare(ref, trace),
                **info_step,
                "eval_rel_diff": harness.loss_rel_diff(ref_evals, evals),
                "eval_bitwise": ref_evals == evals,
                "evals": len(evals),
            }
        return out
    finally:
        torch.backends.cudnn.deterministic = deterministic


REGISTRY = {
    "scaler": scaler,
    "accumulation": accumulation,
    "monitor": monitor,
    "random_numbers": random_numbers,
    "checkpoint": checkpoint,
    "evaluation": evaluation,
}

if __name__ == "__main__":
    harness.run(REGISTRY)
