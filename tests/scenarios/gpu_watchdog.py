"""The replay watchdog on GPUs: one process per mode, since an abort ends the process.

    python tests/scenarios/gpu_watchdog.py MODE OUT_DIR                  # one GPU
    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/scenarios/gpu_watchdog.py peer_stops OUT_DIR             # two GPUs

A replay is made late on purpose by queueing `torch.cuda._sleep` on the replay stream
just before the step is called: the replay cannot start until the sleep ends, which is
what the watchdog sees when a peer never joins the replay's all-reduce (its event does
not complete). No device-side flag is needed: the sleep is queued only for the call that
should be late. Modes (each writes OUT_DIR/MODE.rank<r>.json):

- late_abort: the default policy; the report comes while the GPU is still asleep, the
  next call raises REPLAY_TIMED_OUT, and the process group is aborted.
- stuck: the training thread blocks in `loss.item()` behind the late replay; the process
  ends with the watchdog's exit status within timeout + grace (no JSON).
- report: "report" logs and training goes on once the sleep is over.
- close_then_destroy / forgot_close: the graph freed before the process group, by
  `close()` or by the exit hook; the process must end (the test's timeout guards it).
- destroy_without_close: a probe, not a check: `destroy_process_group()` with a live
  graph and no `close()` (what NCCL >= 2.26 is said to wait for); prints what happened.
- peer_stops (2 GPUs): the last rank stops calling the step; rank 0 keeps training with
  `loss.item()` each step and must fail with the report naming the stopped rank.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from watchdog_common import square_loss_step

import ddpgraph
from ddpgraph import DdpGraphError

TIMEOUT_S = 2.0
GRACE_S = 3.0  # watchdog's wait before ending a process whose training thread is stuck


def setup(
    timeout: float | None = TIMEOUT_S, policy: str = "abort", grace_s: float = 30.0
) -> tuple[Any, Any, Any]:
    info = ddpgraph.init_distributed(timeout_s=120)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    ddp = ddpgraph.prepare_ddp(model.to(info.device), device_ids=[info.device.index])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    step = ddpgraph.capture_step(
        square_loss_step(ddp, opt),
        model=ddp,
        optimizer=opt,
        replay_timeout=timeout,
        on_replay_timeout=policy,  # type: ignore[arg-type]
    )
    step._watchdog.exit_grace_s = grace_s
    return info, step, (torch.randn(32, 64, device=info.device),)


def sleep_cycles(seconds: float) -> int:
    """`torch.cuda._sleep` counts GPU clock cycles; measure how many make a second."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**8)
    end.record()
    end.synchronize()
    return int(seconds * 10**8 / (start.elapsed_time(end) / 1000))


def train_until_captured(step: Any, batch: Any, calls: int = 14) -> None:
    for _ in range(calls):
        step(*batch)
    torch.cuda.synchronize()
    assert step.state.value == "captured", (step.state, step.reason)


def late_call(step: Any, batch: Any, seconds: float) -> float:
    """Queue a sleep on the replay stream, then call the step: its replay is late."""
    torch.cuda._sleep(sleep_cycles(seconds))
    launched = time.monotonic()
    step(*batch)
    return launched


def wait_for(condition: Any, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def late_abort() -> dict[str, Any]:
    _, step, batch = setup()
    train_until_captured(step, batch)
    before = step.stats.replays
    launched = late_call(step, batch, seconds=20.0)
    wait_for(lambda: step._watchdog.failure is not None)
    result: dict[str, Any] = {
        "replays_before": before,
        "reported_after_s": time.monotonic() - launched,
        "stated_bound_s": TIMEOUT_S + 1.0,
        "gpu_busy_at_report": not torch.cuda.current_stream().query(),
    }
    try:
        step(*batch)
        result["raised"] = None
    except DdpGraphError as err:
        result.update(raised=err.code.value, message=str(err))
    # NCCL's abort may wait for the device (it frees memory), which sleeps 20 s here; a
    # real stuck all-reduce returns at the abort instead.
    wait_for(lambda: step._watchdog.aborted_with != "", 60.0)
    result["aborted_with"] = step._watchdog.aborted_with
    result["aborted_after_s"] = time.monotonic() - launched
    return result


def stuck() -> dict[str, Any]:
    _, step, batch = setup(grace_s=GRACE_S)
    train_until_captured(step, batch)
    late_call(step, batch, seconds=60.0)
    loss = step(*batch)
    print("BLOCKING IN ITEM", flush=True)
    return {"item": float(loss.item())}  # reached only if the process was not ended


def report() -> dict[str, Any]:
    _, step, batch = setup(policy="report")
    train_until_captured(step, batch)
    late_call(step, batch, seconds=6.0)
    wait_for(lambda: bool(step._watchdog.reported))
    torch.cuda.synchronize()  # the sleep ends; the late replay finishes
    for _ in range(5):
        step(*batch)
    torch.cuda.synchronize()
    return {
        "reported": [f.code.value for f in step._watchdog.reported],
        "replays": step.stats.replays,
        "state": step.state.value,
    }


def teardown(mode: str) -> dict[str, Any]:
    _, step, batch = setup()
    train_until_captured(step, batch)
    if mode == "close_then_destroy":
        step.close()
    if mode in ("close_then_destroy", "destroy_without_close"):
        start = time.monotonic()
        print(f"DESTROYING ({mode})", flush=True)
        dist.destroy_process_group()
        print(f"DESTROYED after {time.monotonic() - start:.2f} s", flush=True)
    return {"state": step.state.value, "nccl": str(torch.cuda.nccl.version())}


def peer_stops(out: str) -> dict[str, Any]:
    info, step, batch = setup(timeout=5.0, grace_s=GRACE_S)
    train_until_captured(step, batch)
    if info.rank == info.world_size - 1:
        write(out, "peer_stops", info.rank, {"stopped_after_replays": step.stats.replays})
        time.sleep(150)  # stuck in Python, as a hung data loader would be
        with open(os.path.join(out, "stopper_woke"), "w") as fh:
            fh.write("the stopped rank was not ended when another rank failed")
        return {}
    try:
        for _ in range(100_000):
            float(step(*batch).item())
    except (DdpGraphError, RuntimeError) as err:
        return {"raised": type(err).__name__, "message": str(err)}
    return {"raised": None}


def write(out: str, mode: str, rank: int, result: dict[str, Any]) -> None:
    result["rank"] = rank
    with open(os.path.join(out, f"{mode}.rank{rank}.json"), "w") as fh:
        json.dump(result, fh, default=str)


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    runs = {"late_abort": late_abort, "stuck": stuck, "report": report}
    if mode in runs:
        result = runs[mode]()
    elif mode == "peer_stops":
        result = peer_stops(out)
    else:
        result = teardown(mode)
    write(out, mode, dist.get_rank() if dist.is_initialized() else 0, result)
    print(f"DONE {mode}", flush=True)
    if mode in ("late_abort", "peer_stops"):
        # The communicator is aborted and the GPU may still be asleep: end here rather
        # than wait for the watchdog's exit deadline.
        os._exit(3 if mode == "peer_stops" else 0)


if __name__ == "__main__":
    main()
