"""One process whose replay never finishes, for the watchdog's real actions.

    python tests/scenarios/watchdog_process.py MODE OUT_JSON

The replay's event is a stand-in that never completes; the watchdog is real (its
thread, `torch.save` detection and refusal, `os._exit`), only the abort is a stand-in
that prints ABORT CALLED (there is no process group). Modes:

- stuck: the training thread blocks forever after the replay, as it would in
  `loss.item()` behind a replay stuck on the GPU. Expected: exit status EXIT_CODE.
- raises: the training thread keeps calling `check()`, as the step does on each call.
  Expected: DdpGraphError, then `torch.save` refused; exit status 0.
- checkpoint: the training thread is inside a slow `torch.save` when the replay times
  out. Expected: the save completes before the abort; exit status 0.
- checkpoint_stuck: the save blocks forever. Expected: EXIT_CODE, no abort.
- forgot_close: a captured step (stand-in backend, one-process gloo group) is never
  closed; at exit the graph is released while the process group still exists.
- shutdown: the same step, then `ddpgraph.ddp.distributed.shutdown()` without `close()`.
"""

from __future__ import annotations

import io
import json
import sys
import threading
import time
from typing import Any

import torch

from ddpgraph import DdpGraphError
from ddpgraph.agreement.peers import NoBoard
from ddpgraph.watchdog.watch import ReplayWatchdog

TIMEOUT_S = 0.3
result: dict[str, Any] = {}


class NeverEvent:
    def record(self, stream: Any = None) -> None:
        return

    def query(self) -> bool:
        return False


def stand_in_abort(group: Any) -> str:
    result["bytes_at_abort"] = result.get("bytes_written")
    print("ABORT CALLED", file=sys.stderr, flush=True)
    return "stand-in abort"


def make_watchdog(grace_s: float, checkpoint_wait_s: float) -> ReplayWatchdog:
    return ReplayWatchdog(
        TIMEOUT_S,
        "abort",
        "train_step",
        event_factory=NeverEvent,
        board=NoBoard(),
        abort=stand_in_abort,
        exit_grace_s=grace_s,
        checkpoint_wait_s=checkpoint_wait_s,
        poll_s=0.02,
    )


class SlowFile(io.BytesIO):
    """Each write takes a while; `forever` blocks on the second write."""

    def __init__(self, watchdog: ReplayWatchdog, forever: bool = False) -> None:
        super().__init__()
        self.watchdog = watchdog
        self.forever = forever
        self.writes = 0

    def write(self, data: Any) -> int:
        self.writes += 1
        if self.forever and self.writes > 1:
            threading.Event().wait()
        time.sleep(0.05)
        written = super().write(data)
        result["bytes_written"] = self.tell()
        result["reported_while_saving"] = bool(self.watchdog.reported)
        return written


def until_raised(watchdog: ReplayWatchdog) -> None:
    for _ in range(3000):
        try:
            watchdog.check()
        except DdpGraphError as err:
            result["code"] = err.code.value
            break
        time.sleep(0.01)
    for _ in range(3000):  # the abort follows the report: wait for it to have run
        if watchdog._aborter is not None:
            watchdog._aborter.join(30)
            break
        time.sleep(0.01)
    try:
        torch.save({"w": torch.ones(1)}, io.BytesIO())
        result["save_after"] = "written"
    except DdpGraphError as err:
        result["save_after"] = err.code.value


def checkpoint(watchdog: ReplayWatchdog, forever: bool) -> None:
    state = {f"w{i}": torch.full((64,), float(i)) for i in range(30)}
    out = SlowFile(watchdog, forever)
    torch.save(state, out)  # ~2 s of writes, more than TIMEOUT_S
    result["final_bytes"] = len(out.getvalue())
    out.seek(0)
    loaded = torch.load(out)
    result["loads_equal"] = all(torch.equal(loaded[k], v) for k, v in state.items())


def captured_then_exit(mode: str) -> None:
    import torch.distributed as dist
    from watchdog_common import square_loss_step

    import ddpgraph
    from ddpgraph.backends.graph import _PassThroughGraph

    ddpgraph.init_distributed(force_cpu=True, timeout_s=30)
    release = _PassThroughGraph.release

    def recorded_release(graph: Any) -> None:
        print(f"GRAPH RELEASED group_alive={dist.is_initialized()}", flush=True)
        release(graph)

    _PassThroughGraph.release = recorded_release  # type: ignore[method-assign]
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    train_step = square_loss_step(model, opt)
    step = ddpgraph.capture_step(
        train_step, model=model, optimizer=opt, backend=ddpgraph.PassThroughBackend()
    )
    for _ in range(6):
        step(torch.ones(3, 4))
    print(f"STATE {step.state.value} replays={step.stats.replays}", flush=True)
    if mode == "shutdown":
        ddpgraph.ddp.distributed.shutdown()  # closes the live step, then destroys the group
        print(f"SHUT DOWN group_alive={dist.is_initialized()}", flush=True)
    # forgot_close: no close(), no destroy_process_group(): the interpreter exits with both.


def main() -> None:
    mode, out_path = sys.argv[1], sys.argv[2]
    if mode in ("forgot_close", "shutdown"):
        captured_then_exit(mode)
        return
    ends = mode in ("stuck", "checkpoint_stuck")
    watchdog = make_watchdog(
        grace_s=1.0 if ends else 30.0, checkpoint_wait_s=2.0 if ends else 120.0
    )
    watchdog.after_replay()
    if mode == "stuck":
        threading.Event().wait()
    elif mode == "raises":
        until_raised(watchdog)
    elif mode in ("checkpoint", "checkpoint_stuck"):
        checkpoint(watchdog, forever=mode == "checkpoint_stuck")
        until_raised(watchdog)
    with open(out_path, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
