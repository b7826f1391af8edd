"""What watching a step for frozen Python values costs: at warm-up, and per check call
after capture (`capture_step(verify_every=N)`), per model.

    # one GPU, about 3 min:
    torchrun --standalone --nproc_per_node=1 scripts/probes/verify_cost.py \\
        --model hf-gpt2,hf-llama,timm-vit,tv-resnet50 --json $OUT/verify_cost.json
    # CPU, recording backend:
    PYTHONPATH=src torchrun --standalone --nproc_per_node=1 scripts/probes/verify_cost.py \\
        --model gpt --batch 8

Per model (batch `--batch`, bf16 autocast and AdamW on a GPU; fused AdamW and the recording
backend on CPU), in one process, each step synchronised after every call:

* eager: ms per eager DDP step, plain and under the watch (`python_values.watching`),
  alternated so that both see the same machine, and the torch calls one step makes;
* captured with `verify_every=--every`: ms per replay and per check call (a watched
  eager step in place of a replay), medians over `--calls` calls;
* the cost of the check at N=100: (check - replay) / (100 * replay), the fraction of step
  time `verify_every=100` adds (the agreement after a check is one small collective
  with peers, none at one rank).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import ddpgraph
from ddpgraph.app.models import CPU_GPT_CONFIG, Workload, gpt_workload
from ddpgraph.app.reference_step import StepOptions, make_train_step
from ddpgraph.backends.recording import RecordingBackend
from ddpgraph.bench.presets import PRESETS, preset_workload
from ddpgraph.frozen.python_values import ValueWatch, watching
from ddpgraph.optimizer.safe_optimizers import GraphSafeOptimizers

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _workload(name: str, device: torch.device) -> Workload:
    if name in PRESETS:
        return preset_workload(name)
    if name == "gpt":
        return gpt_workload(None if device.type == "cuda" else CPU_GPT_CONFIG)
    raise SystemExit(f"--model: expected gpt or one of {', '.join(PRESETS)}, got {name!r}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(call: Callable[[], Any], device: torch.device) -> float:
    start = time.perf_counter()
    call()
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def _setup(
    work: Workload, device: torch.device
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Step]:
    torch.manual_seed(0)
    ddp = ddpgraph.prepare_ddp(work.build().to(device))
    opt = torch.optim.AdamW(
        ddp.parameters(), lr=1e-4, **({} if device.type == "cuda" else {"fused": True})
    )
    options = StepOptions(amp_dtype=torch.bfloat16 if device.type == "cuda" else None)
    return ddp, opt, make_train_step(ddp, opt, work.loss, options)


def measure(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    work = _workload(name, device)
    gen = torch.Generator().manual_seed(0)
    x, y = work.make_batch(args.batch, gen, torch.device("cpu"))
    x, y = x.to(device), y.to(device)

    # Eager, plain and watched, alternated.
    ddp, opt, fn = _setup(work, device)
    safe = GraphSafeOptimizers([opt], device)
    assert safe.prepare() is None
    plain, watched, calls = [], [], 0

    def under_watch() -> None:
        nonlocal calls
        with watching(ValueWatch(), ddp) as watch:
            fn(x, y)
        calls = len(watch.trace.entries)

    with safe.installed():
        for _ in range(3):
            fn(x, y)
        for _ in range(args.eager_steps):
            plain.append(_timed(lambda: fn(x, y), device))
            watched.append(_timed(under_watch, device))
    safe.released()
    del ddp, opt, fn

    # Captured, with a check every `--every` calls.
    ddp, opt, fn = _setup(work, device)
    backend = None if device.type == "cuda" else RecordingBackend()
    step = ddpgraph.capture_step(
        fn, model=ddp, optimizer=opt, backend=backend, verify_every=args.every
    )
    while step.state is ddpgraph.StepState.WARMUP:
        step(x, y)
    replays, checks = [], []
    # On CPU, transformers' models read a mask on the host, which a recording refuses
    # (not on a GPU): their row has the eager columns only.
    captured = step.state is ddpgraph.StepState.CAPTURED
    for _ in range(args.calls if captured else 0):
        before = step.stats.value_checks
        ms = _timed(lambda: step(x, y), device)
        (checks if step.stats.value_checks != before else replays).append(ms)
    not_captured = None if step.reason is None else step.reason.format()
    step.close()
    med = {
        k: statistics.median(v) if v else float("nan")
        for k, v in (("eager", plain), ("watched", watched), ("replay", replays), ("check", checks))
    }
    return {
        "not_captured": not_captured,
        "model": name,
        "batch": args.batch,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_calls_per_step": calls,
        "eager_ms": med["eager"],
        "watched_eager_ms": med["watched"],
        "watch_us_per_call": (med["watched"] - med["eager"]) * 1e3 / max(calls, 1),
        "replay_ms": med["replay"],
        "check_ms": med["check"],
        "checks": len(checks),
        "cost_at_100": (med["check"] - med["replay"]) / (100 * med["replay"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model", default="gpt", help="comma-separated: gpt, or presets " + ", ".join(PRESETS)
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--eager-steps", type=int, default=10)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument(
        "--every",
        type=int,
        default=20,
        help="verify_every for the timed run (checks sampled often)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    info = ddpgraph.init_distributed()
    rows = []
    for name in args.model.split(","):
        row = measure(name, args, info.device)
        rows.append(row)
        if info.rank == 0:
            if row["not_captured"]:
                print(f"{name}: not captured: {row['not_captured']}", flush=True)
            print(
                f"{name}: {row['torch_calls_per_step']} torch calls per step; "
                f"eager {row['eager_ms']:.2f} ms, watched {row['watched_eager_ms']:.2f} ms "
                f"({row['watch_us_per_call']:.2f} us per call); replay {row['replay_ms']:.2f} ms, "
                f"check {row['check_ms']:.2f} ms ({row['checks']} checks); "
                f"verify_every=100 costs {row['cost_at_100'] * 100:.2f}% of step time",
                flush=True,
            )
        if info.device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json and info.rank == 0:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
