"""What the parity check costs at capture, on CPU with the stand-in backend.

    PYTHONPATH=src python scripts/probes/parity_cost.py [--width 512] [--layers 4]

Times the call that captures (warm-up 3, then the recording and the first replay) with
and without `parity=True`, and prints the bytes the check keeps while it runs (value
copies of parameters, gradients, buffers and optimizer state) against the parameters'.
On CPU the stand-in's "replay" runs the step again, so the check costs about one more
step; on CUDA it costs one eager step (the replay is the one training makes anyway).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import ddpgraph
from ddpgraph.step.parity import ParityCheck, ParityRun


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    x, y = torch.randn(64, args.width), torch.randint(0, 10, (64,))

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 10))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def capture_call(parity: bool) -> float:
        model, opt = build()

        def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        step = ddpgraph.capture_step(
            fn, model=model, optimizer=opt, backend=ddpgraph.PassThroughBackend(), parity=parity
        )
        for _ in range(3):
            step(x, y)
        start = time.perf_counter()
        step(x, y)
        elapsed = time.perf_counter() - start
        assert step.state is ddpgraph.StepState.CAPTURED, step.reason
        step.close()
        return elapsed

    def eager_step() -> float:
        model, opt = build()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        return time.perf_counter() - start

    one_step = statistics.median(eager_step() for _ in range(args.repeats))
    plain = statistics.median(capture_call(False) for _ in range(args.repeats))
    checked = statistics.median(capture_call(True) for _ in range(args.repeats))
    model, opt = build()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    run = ParityRun(ParityCheck(), model, [opt])
    run.run(lambda: None, lambda: None)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"model: {args.layers + 1} linear layers of width {args.width}, "
        f"{param_bytes / 2**20:.1f} MiB of parameters, AdamW"
    )
    print(
        f"capturing call: {plain * 1e3:.1f} ms without the check, {checked * 1e3:.1f} ms with it "
        f"(+{(checked - plain) * 1e3:.1f} ms, {(checked - plain) / one_step:.1f} "
        f"eager steps of {one_step * 1e3:.1f} ms)"
    )
    print(
        f"held during the check: {run.saved_bytes / 2**20:.1f} MiB = "
        f"{run.saved_bytes / param_bytes:.2f} x the parameters"
    )


if __name__ == "__main__":
    main()
