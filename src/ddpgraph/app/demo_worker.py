"""What each torchrun worker of `ddpgraph demo` runs (`demo` is the command): the three
runs from the same weights on the same batches, eager with the default AdamW, eager with
the graph-safe AdamW and captured, then, on rank 0, the table and the JSON file.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ..backends.graph import emulation_backend
from ..capture import capture_step
from ..ddp.build import infer_device_ids, prepare_ddp
from ..ddp.distributed import DistInfo, init_distributed, shutdown
from ..ddp.streams import synchronize
from ..optimizer.graph_safe import graph_safe_optimizer
from .console import console, progress_bar, rank0_print
from .models import CPU_GPT_CONFIG, GPTConfig, Workload, cosine_with_warmup, gpt_workload
from .reference_step import StepOptions, Timing, make_train_step

GPU_CONFIG = GPTConfig()  # 6 layers, d=384, 6 heads, T=128, vocab 1000
CPU_CONFIG = CPU_GPT_CONFIG


@dataclass
class RunResult:
    name: str
    ms_per_step: float
    spread_ms: float
    losses: list[float] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list, repr=False)
    note: str = ""
    replays: int = 0  # graph replays; 0 for a run that never ran a captured step


def main(args: argparse.Namespace) -> int:
    """One worker's demo, its arguments checked already (`demo.check_args`)."""
    info = init_distributed(force_cpu=args.cpu)
    try:
        results, reason = run(info, args)
        if info.is_main:
            _print(info, args, results, reason)
            if args.json_path:
                _write_json(args.json_path, info, results, reason)
    finally:
        shutdown()
    return 0


def run(info: DistInfo, args: argparse.Namespace) -> tuple[list[RunResult], str]:
    cuda = info.device.type == "cuda"
    cfg = GPU_CONFIG if cuda else CPU_CONFIG
    steps = args.steps if args.steps is not None else (300 if cuda else 40)
    workload = gpt_workload(cfg)
    options = StepOptions(amp_dtype=torch.bfloat16 if cuda else None, clip_norm=1.0)
    gen = torch.Generator().manual_seed(1234 + info.rank)
    batches = [workload.make_batch(args.batch, gen, info.device) for _ in range(16)]
    runs: list[tuple[str, Callable[..., RunResult]]] = [
        ("eager DDP, default AdamW", _eager(graph_safe=False)),
        ("eager DDP, graph-safe AdamW", _eager(graph_safe=True)),
        ("capture_step", _captured),
    ]
    results: list[RunResult] = []
    reason = ""
    with progress_bar(info.is_main) as bar:
        task = bar.add_task("training", total=steps * len(runs))
        for name, fn in runs:
            bar.update(task, description=name)
            result = fn(name, info, workload, options, batches, steps, lambda: bar.advance(task))
            if result.note:
                reason = result.note
            results.append(result)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    return results, reason


def _model(info: DistInfo, workload: Workload) -> torch.nn.Module:
    torch.manual_seed(0)  # same initial weights for every run, on every rank
    return workload.build().to(info.device)


def _loop(
    name: str,
    step_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    sched: torch.optim.lr_scheduler.LRScheduler,
    model: torch.nn.Module,
    info: DistInfo,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    tick: Callable[[], None],
) -> RunResult:
    skip = min(steps // 3, 40)  # warm-up and capture are not what we time
    window = max(1, (steps - skip) // 8)
    timing = Timing()
    losses: list[torch.Tensor] = []
    start = 0.0
    for i in range(steps):
        if i >= skip and (i - skip) % window == 0:
            synchronize(info.device)
            now = time.perf_counter()
            if i > skip:
                timing.window_ms.append((now - start) * 1000 / window)
            start = now
        x, y = batches[i % len(batches)]
        loss = step_fn(x, y)
        losses.append(loss.detach())  # a replay returns a copy (`clone_outputs`): kept as is
        sched.step()
        tick()
    synchronize(info.device)
    params = [p.detach().float().cpu() for p in model.parameters()]
    return RunResult(name, timing.median_ms, timing.spread_ms, [float(v) for v in losses], params)


def _training(info: DistInfo, workload: Workload, steps: int, *, prepared: bool):  # type: ignore[no-untyped-def]
    """The model, optimizer and schedule every run starts from."""
    model = _model(info, workload)
    ddp = (
        prepare_ddp(model)
        if prepared
        else DDP(model, device_ids=infer_device_ids({info.device}, None))
    )
    # On CPU, the fused kernel: the foreach one reads its step count on the host, which
    # the emulated capture refuses as a GPU capture refuses it.
    fused = None if info.device.type == "cuda" else True
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(steps))
    return ddp, opt, sched


def _eager(graph_safe: bool) -> Callable[..., RunResult]:
    # Plain DDP on the default stream: a model from prepare_ddp belongs to the capture
    # stream, and training it on another stream is what capture_step avoids.
    def run(name, info, workload, options, batches, steps, tick):  # type: ignore[no-untyped-def]
        ddp, opt, sched = _training(info, workload, steps, prepared=False)
        if graph_safe:
            # Converted after the scheduler exists, as capture_step converts in the
            # captured run: a scheduler built before computes learning rates in float64,
            # one built after in float32, and the two differ in the last bit.
            graph_safe_optimizer(opt, tensor_lr_on_cpu=True)
        step = make_train_step(ddp, opt, workload.loss, options)
        return _loop(name, step, sched, ddp, info, batches, steps, tick)

    return run


def _captured(name, info, workload, options, batches, steps, tick):  # type: ignore[no-untyped-def]
    ddp, opt, sched = _training(info, workload, steps, prepared=True)
    backend = None if info.device.type == "cuda" else emulation_backend()
    with capture_step(
        make_train_step(ddp, opt, workload.loss, options), model=ddp, optimizer=opt, backend=backend
    ) as step:
        result = _loop(name, step, sched, ddp, info, batches, steps, tick)
        s = step.stats
        result.replays = s.replays
        if step.reason is not None:
            result.note = step.reason.format()
            how = f"fell back after {s.replays} replays" if s.replays else "ran eagerly"
            result.name = f"{name} ({how}: {step.reason.code.name})"
        else:
            result.note = ""
            result.name = (
                f"{name} ({s.warmup_steps} warm-up, capture {1000 * (s.capture_seconds or 0):.0f} "
                f"ms, {s.replays} replays)"
            )
    return result


def _max_abs(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def _param_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True))
    den = sum(float(x.pow(2).sum()) for x in a)
    return (num / den) ** 0.5 if den else 0.0


def _print(info: DistInfo, args: argparse.Namespace, results: list[RunResult], reason: str) -> None:
    from rich.table import Table

    base, ref, cap = results
    where = (
        f"{info.world_size} × {torch.cuda.get_device_name(info.device)}"
        if info.device.type == "cuda"
        else f"{info.world_size} CPU processes (gloo), capture emulated on CPU"
    )
    table = Table(
        title=f"ddpgraph demo: TinyGPT, batch {args.batch}/rank, {len(base.losses)} steps, {where}"
    )
    table.add_column("run")
    table.add_column("ms/step", justify="right")
    table.add_column("speedup", justify="right")
    table.add_column("final loss", justify="right")
    for r in results:
        table.add_row(
            r.name,
            f"{r.ms_per_step:.2f} ± {r.spread_ms / 2:.2f}",
            f"{base.ms_per_step / r.ms_per_step:.2f}×",
            f"{r.losses[-1]:.4f}",
        )
    console().print(table)
    if cap.replays == 0:
        # Every row ran eagerly: a speedup there is run-to-run noise, not a gain.
        rank0_print(
            "Nothing was captured, so all three runs are eager; their ms/step differ only by noise."
        )
    elif info.device.type != "cuda":
        rank0_print(
            "CPU emulation: capture_step recorded the step once and replayed its operations and "
            "all-reduces without Python (ddpgraph's recording backend). The times are CPU times, "
            "not a GPU speed-up."
        )
    loss_diff = _max_abs(ref.losses, cap.losses)
    param_diff = _param_rel(ref.params, cap.params)
    agree = "agree" if loss_diff <= 1e-5 and param_diff <= 1e-5 else "DIFFER"
    rank0_print(
        f"Losses of capture_step and eager (same graph-safe AdamW) {agree}: "
        f"max |Δloss| = {loss_diff:.2e} over {len(cap.losses)} steps, "
        f"relative parameter difference {param_diff:.2e}."
    )
    rank0_print(
        f"Against the default AdamW (other rounding, same math): max |Δloss| = "
        f"{_max_abs(base.losses, cap.losses):.2e}."
    )
    if reason:
        rank0_print(f"capture_step did not capture:\n{reason}")


def _write_json(path: str, info: DistInfo, results: list[RunResult], reason: str) -> None:
    payload = {
        "world_size": info.world_size,
        "device": torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "runs": [
            {
                "name": r.name,
                "ms_per_step": r.ms_per_step,
                "spread_ms": r.spread_ms,
                "losses": r.losses,
            }
            for r in results
        ],
        "max_abs_loss_diff_captured_vs_graph_safe_eager": _max_abs(
            results[1].losses, results[2].losses
        ),
        "param_rel_diff_captured_vs_graph_safe_eager": _param_rel(
            results[1].params, results[2].params
        ),
        "reason": reason,
    }
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=2)
