"""How long a timing window must be for a DataLoader feed to cost what it costs a loop.

    # one GPU, about 3 min:
    torchrun --standalone --nproc_per_node=1 scripts/probes/feed_windows.py \\
        --model hf-llama,timm-vit --strategies whole,compile,reduce-overhead

Per model and strategy, with the bench's own runners (`ddpgraph.bench.strategies`): warm
up on the device feed and time it, then the same on the bench's DataLoader feed (pinned,
4 workers), in windows of 1, 2, 5, 10 and 20 steps, each window ended by a device
synchronisation and nothing synchronised inside it. Prints ms/step per feed and
window, and the host's time to take one batch from the loader (`next()`), median.
`--paired N` then alternates windows of the device feed and the loop-moved feed N times,
for a ratio that drift cannot bias; `--profile N` prints each feed's host time per op.

A window of one step exposes everything the host does before the step's first kernel
(taking the batch, its copy) at every step; a training loop synchronises only when it
logs, so its host runs ahead and hides that under the previous step's GPU work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import ddpgraph
from ddpgraph.bench import strategies as _strategies  # noqa: F401  (fills the registry)
from ddpgraph.bench.case import Case, Runner
from ddpgraph.bench.feeds import Batch, device_feed, host_batches, loader_feed
from ddpgraph.bench.presets import preset_workload
from ddpgraph.bench.registry import select
from ddpgraph.ddp.streams import synchronize

WINDOWS = (1, 2, 5, 10, 20)


def _window_ms(runner: Runner, feed: Iterator[Batch], count: int, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    for _ in range(count):
        x, y = next(feed)
        runner.step(x, y)
    synchronize(device)
    return (time.perf_counter() - start) * 1e3 / count


def _to(feed: Iterator[Batch], device: torch.device) -> Iterator[Batch]:
    for x, y in feed:
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def _profile(
    name: str, runner: Runner, feed: Iterator[Batch], steps: int, device: torch.device
) -> None:
    """The host's own time per op over `steps` steps of one feed: where a feed's extra
    milliseconds go when the step is bound by the host."""
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _window_ms(runner, feed, steps, device)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    cells = ", ".join(f"{e.key} {e.self_cpu_time_total / steps:.0f}" for e in rows[:12])
    total = sum(e.self_cpu_time_total for e in rows) / steps
    print(f"  profile {name}: self CPU us/step {total:.0f}: {cells}", flush=True)


def measure(model: str, strategy: str, args: argparse.Namespace, device: torch.device) -> Any:
    work = preset_workload(model)
    on_cuda = device.type == "cuda"
    case = Case(work, args.batch, device, torch.bfloat16 if on_cuda else None)
    batches = host_batches(work, args.batch, 0)
    (chosen,) = select([strategy])
    assert chosen.build is not None
    runner = chosen.build(case, case.fresh_model())
    windows = [int(w) for w in args.windows.split(",")]
    per_window = sum(windows) * args.repeats + args.profile
    device_batches = device_feed(batches, device)
    loader = loader_feed(batches, 40 + per_window, workers=4, pin_memory=on_cuda)
    paired_steps = args.paired * max(windows)
    moved = loader_feed(batches, 20 + per_window + paired_steps, workers=4, pin_memory=on_cuda)
    # Other loader setups (--loaders), to tell the pin-memory thread's share from the
    # workers': "4:unpinned" is 4 workers without pinning, "0:pinned" no workers.
    others = {
        spec: loader_feed(
            batches,
            20 + per_window,
            workers=int(spec.split(":")[0]),
            pin_memory=spec.endswith(":pinned"),
        )
        for spec in filter(None, args.loaders.split(","))
    }
    times: dict[str, dict[int, list[float]]] = {
        name: {} for name in ("device", "dataloader", "moved", *others, "device-again")
    }
    paired: list[float] = []
    moved_batches = _to(moved, device)
    try:
        # One feed after the other, as the bench runs them: a captured step given host
        # inputs after device ones is a new step, which captures again in its warm-up.
        # "moved": the DataLoader's batches copied to the device by the loop itself
        # (`.to(device, non_blocking=True)`), as most training scripts write it.
        feeds = (
            ("device", device_batches),
            ("dataloader", loader),
            ("moved", moved_batches),
            *others.items(),
            ("device-again", device_batches),  # the same feed later: drift over time
        )
        for name, feed in feeds:
            for _ in range(20):  # compile, DDP's first iterations, capture
                runner.step(*next(feed))
            for _ in range(args.repeats):
                for w in windows:
                    times[name].setdefault(w, []).append(_window_ms(runner, feed, w, device))
            if args.profile:
                _profile(name, runner, feed, args.profile, device)
        # Paired rounds: a window of the device feed, then one of the loop-moved feed,
        # again and again, so both see the same drift of a host-bound step's speed.
        # (Both give the step device tensors: no runner sees a new kind of input.)
        for _ in range(args.paired):
            pair = [
                _window_ms(runner, f, max(windows), device) for f in (device_batches, moved_batches)
            ]
            paired.append(pair[1] / pair[0])
        takes = []
        for _ in range(10):
            start = time.perf_counter()
            x, y = next(loader)
            takes.append((time.perf_counter() - start) * 1e6)
            runner.step(x, y)
            synchronize(device)
    finally:
        for feed in (loader, moved, *others.values()):
            feed.close()
        runner.close()
    row = {
        "model": model,
        "strategy": strategy,
        "eager_calls": getattr(runner, "eager_calls", None),
        "next_us": statistics.median(takes),
        "paired_moved_over_device": paired,
        "ms": {
            feed: {w: statistics.median(v) for w, v in per.items()} for feed, per in times.items()
        },
    }
    del runner
    if on_cuda:
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="hf-llama,timm-vit")
    parser.add_argument("--strategies", default="whole,compile,reduce-overhead")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--windows", default=",".join(map(str, WINDOWS)))
    parser.add_argument("--loaders", default="", help='more loader setups: "4:unpinned,0:pinned"')
    parser.add_argument("--paired", type=int, default=0, help="alternate device/moved N times")
    parser.add_argument("--profile", type=int, default=0, help="profile N steps of each feed")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    info = ddpgraph.init_distributed()
    rows = []
    for model in args.model.split(","):
        for strategy in args.strategies.split(","):
            row = measure(model, strategy, args, info.device)
            rows.append(row)
            ms = row["ms"]
            cells = "; ".join(
                f"w{w}: {ms['device'][w]:.2f} / {ms['dataloader'][w]:.2f} / {ms['moved'][w]:.2f}"
                f" ({ms['dataloader'][w] / ms['device'][w]:.3f}, "
                f"{ms['moved'][w] / ms['device'][w]:.3f})"
                for w in ms["device"]
            )
            cells += "".join(
                f"; {name} w{w}: {ms[name][w]:.2f} ({ms[name][w] / ms['device'][w]:.3f})"
                for name in ms
                if name not in ("device", "dataloader", "moved")
                for w in ms[name]
            )
            if row["paired_moved_over_device"]:
                pairs = sorted(row["paired_moved_over_device"])
                cells += (
                    f"; paired moved/device: median {statistics.median(pairs):.3f}"
                    f" ({pairs[0]:.3f}-{pairs[-1]:.3f}, {len(pairs)} rounds)"
                )
            print(
                f"{model} {strategy}: device / DataLoader / moved by the loop, ms/step by "
                f"window: {cells}; "
                f"next() {row['next_us']:.0f} us; eager calls {row['eager_calls']}",
                flush=True,
            )
    if args.json and info.rank == 0:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
