"""What a call the one captured graph cannot serve costs, against an eager DDP step.

    # one GPU, about 40 s:
    torchrun --standalone --nproc_per_node=1 scripts/probes/unserved_calls.py

A transformers GPT-2 124M (the `hf-gpt2` preset, batch 8, bf16 autocast, AdamW) trained on
30 lengths drawn from 64..512, three ways in one process, in turns: eager DDP; eager DDP
with `AdamW(capturable=True)` (the graph-safe kernel that every eager step of a captured
step runs, so that it matches the replays); and `capture_step` captured at length 100,
so that every timed call runs eagerly. Each way sees every length once before it is
timed (cuDNN builds its attention plans per shape), and no profiler runs (see
`profiler_teardown.py`). Prints ms per step and the host's median per call, per round,
then where the host's time goes (cProfile) for eager and for the unserved calls.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import random
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpgraph
from ddpgraph.app.reference_step import StepOptions, make_train_step
from ddpgraph.bench.presets import hf_gpt2

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OPTIONS = StepOptions(amp_dtype=torch.bfloat16, clip_norm=None)


def main() -> None:
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    workload = hf_gpt2()

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return workload.build().to(dev)

    rng = random.Random(0)
    lengths = [rng.randint(64, 512) for _ in range(30)]
    batches = {
        t: (
            torch.randint(0, 50257, (8, t), device=dev),
            torch.randint(0, 50257, (8, t), device=dev),
        )
        for t in {*lengths, 100}
    }
    steps: dict[str, Step] = {}
    ddp = DDP(build(), device_ids=[0])
    steps["eager"] = make_train_step(
        ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4), workload.loss, OPTIONS
    )
    ddp = DDP(build(), device_ids=[0])
    capturable = torch.optim.AdamW(ddp.parameters(), lr=1e-4, capturable=True)
    steps["eager, capturable AdamW"] = make_train_step(ddp, capturable, workload.loss, OPTIONS)
    ddp = ddpgraph.prepare_ddp(build())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    captured = ddpgraph.capture_step(
        make_train_step(ddp, opt, workload.loss, OPTIONS), model=ddp, optimizer=opt
    )
    for _ in range(20):
        if captured.state is ddpgraph.StepState.CAPTURED:
            break
        captured(*batches[100])
    print(f"capture_step: {captured.state.value}, reason {captured.reason}")
    steps["capture_step, unserved"] = captured

    for fn in steps.values():
        for t in lengths:
            fn(*batches[t])
    for round_ in range(3):
        for name, fn in steps.items():
            host: list[float] = []
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for t in lengths:
                a = time.perf_counter()
                fn(*batches[t])
                host.append(time.perf_counter() - a)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) / len(lengths) * 1e3
            print(
                f"round {round_} {name:26s} {ms:7.2f} ms/step, host median "
                f"{sorted(host)[len(host) // 2] * 1e3:6.2f} ms"
            )
    for name in ("eager", "capture_step, unserved"):
        prof = cProfile.Profile()
        prof.enable()
        for t in lengths[:10]:
            steps[name](*batches[t])
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
        print(f"--- where the host's time goes, {name}, 10 steps\n{out.getvalue()}")
    print(f"stats: {captured.stats}")
    captured.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
