"""Can a DDP built on the default stream be captured whole? A raw experiment, one GPU.

    python scripts/probes/adopt_ddp_probe.py

Each case runs in its own process (a failed capture can leave CUDA unusable for the
rest of a process) with a one-rank NCCL group, and prints one PASS/FAIL line:

  a  DDP built on the default stream, warmed up 12 steps there, captured on a side
     stream with nothing done about its accumulators        (expected: FAIL)
  b  the same, with the reducer rebuilt on the side stream before warm-up
     (`ddpgraph.ddp.adopt.rebuild_reducer`), then warmed up and captured on it; the replays
     must train equal to a twin DDP trained eagerly on the default stream (expected: PASS)
  c  the same as a, but with torch's `set_override_stale_capture_stream(True)` during
     the capture (SKIP where this PyTorch has no such switch)

Only torch and `ddpgraph.ddp.adopt` are used, so the mechanism is shown even where the rest
of ddpgraph would get it wrong.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

CASES = {
    "a": "default-stream DDP captured on a side stream, not adopted",
    "b": "default-stream DDP, reducer rebuilt on the capture stream",
    "c": "default-stream DDP, override_stale_capture_stream switch on",
}
EXPECTED = {"a": "FAIL", "b": "PASS", "c": "PASS"}
WARMUP, REPLAYS = 12, 8


def run_case(case: str) -> str:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpgraph.ddp.adopt import rebuild_reducer

    switch = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
    if case == "c" and switch is None:
        return "SKIP no set_override_stale_capture_stream in this PyTorch"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    dev = torch.device("cuda", 0)
    side = torch.cuda.Stream()

    def build() -> tuple[DDP, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10)).to(dev)
        ddp = DDP(net, device_ids=[0])  # on the default stream, as users write it
        opt = torch.optim.AdamW(
            ddp.parameters(), lr=torch.tensor(1e-3, device=dev), capturable=True
        )
        return ddp, opt

    gen = torch.Generator().manual_seed(3)
    data = [
        (
            torch.randn(32, 64, generator=gen).to(dev),
            torch.randint(0, 10, (32,), generator=gen).to(dev),
        )
        for _ in range(WARMUP + REPLAYS)
    ]

    def step(
        ddp: DDP, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    twin, twin_opt = build()
    for x, y in data:
        step(twin, twin_opt, x, y)

    ddp, opt = build()
    warm_stream = torch.cuda.current_stream()
    if case == "b":
        rebuild_reducer(ddp, side)
        warm_stream = side
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm_stream):
        for x, y in data[:WARMUP]:
            step(ddp, opt, x, y)
    side.wait_stream(warm_stream)
    static_x, static_y = data[WARMUP][0].clone(), data[WARMUP][1].clone()
    graph = torch.cuda.CUDAGraph()
    if case == "c":
        switch(True)
    try:
        with torch.cuda.graph(graph, stream=side):
            step(ddp, opt, static_x, static_y)
    except Exception as err:  # the probe reports any failure as its result
        return f"FAIL capture: {str(err).splitlines()[0][:160]}"
    finally:
        if case == "c":
            switch(False)
    for x, y in data[WARMUP:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(ddp.parameters(), twin.parameters(), strict=True))
    worst = max(
        float((a - b).abs().max()) for a, b in zip(ddp.parameters(), twin.parameters(), strict=True)
    )
    del graph
    dist.destroy_process_group()
    if worst > 1e-5:
        return f"FAIL replays differ from eager training (max abs diff {worst:.3g})"
    return (
        f"PASS captured, {REPLAYS} replays equal to eager "
        f"({'bit for bit' if same else f'max abs diff {worst:.3g}'})"
    )


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--case":
        print("RESULT", run_case(sys.argv[2]), flush=True)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("SKIP: this probe needs a CUDA GPU")
        return 0
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1")
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(here, "..", "..", "src"), env.get("PYTHONPATH", "")]
    )
    wrong = 0
    print(f"{'case':<5}{'expected':<10}{'got':<6}detail")
    for case, title in CASES.items():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(s.getsockname()[1])
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--case", case],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
        except subprocess.TimeoutExpired:
            result = "FAIL hung for 300 s"
        else:
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            result = (
                lines[-1][len("RESULT ") :]
                if lines
                else f"FAIL crashed: {proc.stderr.strip().splitlines()[-1:]}"
            )
        got = result.split()[0]
        wrong += got not in (EXPECTED[case], "SKIP")
        print(f"{case:<5}{EXPECTED[case]:<10}{got:<6}{title}: {result[len(got) + 1 :]}")
    print("all cases as expected" if not wrong else f"{wrong} case(s) not as expected")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
