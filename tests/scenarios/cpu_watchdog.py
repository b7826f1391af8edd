"""One rank stops calling the captured step; the others must report and fail, not hang.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/scenarios/cpu_watchdog.py --out DIR

On CPU the stand-in backend replays synchronously, so the collective a real replay would
wait in is emulated by the replay's event: `PeerEvent` finishes once every rank has
launched that replay, as an all-reduce finishes once every rank joined it. Launches are
counted under this script's own keys in torchrun's store. The model is a plain module,
so the replays run no gloo collective that would block the training thread instead.

The last rank stops after STOP_AFTER calls and sleeps; if it ever wakes it writes a
marker, which the test treats as a failure: torchrun must end it when another rank fails.
Each other rank calls the step until it raises, writes what it saw, and exits with 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from watchdog_common import square_loss_step

import ddpgraph
import ddpgraph.watchdog.watch
from ddpgraph import DdpGraphError
from ddpgraph.watchdog.groups import job_store

STOP_AFTER = 6  # 3 warm-up calls, the capture (replay 1), replays 2 and 3
TIMEOUT_S = 5.0  # the stopped rank publishes every 1.25 s: a wide margin on a loaded machine


class PeerEvent:
    launched = 0

    def __init__(self) -> None:
        self.replay = 0
        self.store = job_store()
        self.world = dist.get_world_size()

    def record(self, stream: Any = None) -> None:
        PeerEvent.launched += 1
        self.replay = PeerEvent.launched
        self.store.set(f"test/launched/{dist.get_rank()}", str(self.replay))

    def query(self) -> bool:
        for rank in range(self.world):
            key = f"test/launched/{rank}"
            if not self.store.check([key]) or int(self.store.get(key)) < self.replay:
                return False
        return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    info = ddpgraph.init_distributed(force_cpu=True, timeout_s=120)
    ddpgraph.watchdog.watch.event_factory_for = lambda device: PeerEvent  # type: ignore[assignment]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    train_step = square_loss_step(model, opt)
    step = ddpgraph.capture_step(
        train_step,
        model=model,
        optimizer=opt,
        backend=ddpgraph.PassThroughBackend(),
        replay_timeout=TIMEOUT_S,
    )
    stopper = info.world_size - 1
    result: dict[str, Any] = {"rank": info.rank, "world_size": info.world_size}
    path = os.path.join(out, f"watchdog.rank{info.rank}.json")
    x = torch.ones(4, 8)
    if info.rank == stopper:
        for _ in range(STOP_AFTER):
            step(x)
        result.update(stopped_after_replays=step.stats.replays)
        with open(path, "w") as fh:
            json.dump(result, fh)
        time.sleep(150)  # a rank stuck in Python: a data loader that never returns
        with open(os.path.join(out, "stopper_woke"), "w") as fh:
            fh.write("the stopped rank was not ended when another rank failed")
        return
    start = time.monotonic()
    try:
        for _ in range(100_000):
            step(x)
            time.sleep(0.02)
    except DdpGraphError as err:
        result.update(code=err.code.value, message=str(err), replays=step.stats.replays)
    result["seconds"] = time.monotonic() - start
    with open(path, "w") as fh:
        json.dump(result, fh)
    sys.exit(3)


if __name__ == "__main__":
    main()
