"""Whether a finished torch.profiler session slows the kernel launches that follow it.

    python scripts/probes/profiler_teardown.py                    # one GPU, about 30 s
    TEARDOWN_CUPTI=1 python scripts/probes/profiler_teardown.py   # with Kineto's teardown

Times an eager GPT-2 training step (transformers `GPT2Config()`, batch 8, 128 tokens,
bf16 autocast, AdamW; no DDP), which is bound by launching kernels: before any profile,
after one profile of three steps, and after two more profiles with a CUDA graph replayed
inside them (the case in which torch turns Kineto's teardown off below CUDA 12.6). The
bench profiles each row after timing it (`ddpgraph.bench.busy`), so this is what the
rows after the first one would pay.
"""

from __future__ import annotations

import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ddpgraph.app.reference_step import StepOptions, make_train_step
from ddpgraph.bench.presets import hf_gpt2


def main() -> None:
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    workload = hf_gpt2()
    model = workload.build().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 50257, (8, 128), device=dev)

    train = make_train_step(
        model, opt, workload.loss, StepOptions(amp_dtype=torch.bfloat16, clip_norm=None)
    )

    def step() -> None:
        train(x, x)

    def ms_per_step(n: int = 30) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e3

    for _ in range(10):
        step()
    before = [ms_per_step(), ms_per_step()]
    with profile(activities=[ProfilerActivity.CUDA]):
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    after_one = [ms_per_step(), ms_per_step()]

    buf = torch.zeros(1 << 20, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        buf.add_(1)  # warm the kernel up outside the recording
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        buf.add_(1)
    for with_steps in (False, True):
        with profile(activities=[ProfilerActivity.CUDA]):
            for _ in range(3):
                graph.replay()
                if with_steps:
                    step()
            torch.cuda.synchronize()
    after_graphs = ms_per_step()

    print(
        f"TEARDOWN_CUPTI={os.environ.get('TEARDOWN_CUPTI')}: ms per eager step before any "
        f"profile {before[0]:.2f}, {before[1]:.2f}; after one profile {after_one[0]:.2f}, "
        f"{after_one[1]:.2f}; after two more with a CUDA graph {after_graphs:.2f}"
    )


if __name__ == "__main__":
    main()
