"""Host time ddpgraph adds to one replayed training step, on CPU, without a GPU.

    PYTHONPATH=src python scripts/replay_overhead.py            # the demo's GPT (6 x 384)
    PYTHONPATH=src python scripts/replay_overhead.py --calls 20000

The step is the demo's GPT step on DDP over a one-process gloo group, captured with a
stand-in backend whose replay does nothing: what a call costs is then exactly what
`CapturedStep` does around a replay (the argument check, the guards, the copy into the
static inputs). Prints the fastest and the median round, in microseconds per call: on a
shared machine the fastest round is the one least disturbed by other work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

import ddpgraph
from ddpgraph.app.models import GPTConfig, gpt_workload


class _IdleGraph:
    def __init__(self, outputs: Any) -> None:
        self.outputs = outputs

    def replay(self) -> None:
        pass

    def release(self) -> None:
        self.outputs = None


class IdleBackend:
    """Records by running the step once; replays do no work at all."""

    name = "idle"
    executes_during_capture = True

    def capture(
        self,
        fn: Callable[[], Any],
        *,
        stream: Any,
        pool: Any,
        generators: Sequence[torch.Generator] = (),
    ) -> _IdleGraph:
        return _IdleGraph(fn())


def captured_demo_step(**options: Any) -> tuple[Any, torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The demo GPT's step captured on the idle backend (gloo, world size 1), its model
    and one batch; `options` go to `capture_step`."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    work = gpt_workload(GPTConfig())
    model = ddpgraph.prepare_ddp(work.build())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = work.make_batch(2, torch.Generator().manual_seed(0), torch.device("cpu"))

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = work.loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    step = ddpgraph.capture_step(
        train_step, model=model, optimizer=opt, backend=IdleBackend(), **options
    )
    while step.state is not ddpgraph.StepState.CAPTURED:
        step(x, y)
    return step, model, x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument(
        "--no-watchdog", action="store_true", help="replay_timeout=None: the guards alone"
    )
    args = parser.parse_args()
    step, model, x, y = captured_demo_step(**({"replay_timeout": None} if args.no_watchdog else {}))
    rounds = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for _ in range(args.calls):
            step(x, y)
        rounds.append((time.perf_counter() - start) / args.calls * 1e6)
    params = sum(1 for _ in model.parameters())
    print(
        f"{params} parameter tensors; host time per replayed call: "
        f"fastest round {min(rounds):.2f} us, median {statistics.median(rounds):.2f} us"
    )
    step.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
