"""Host time of the parts of one replayed call, on the demo GPT (77 parameter tensors).

    python scripts/probes/replay_parts.py        # CPU, about 20 s

The same setup as scripts/replay_overhead.py (gloo, world size 1, a backend whose replay
does nothing), then each piece the replay path runs, timed alone: fastest of 7 rounds of
3000 calls, in µs per call. The pieces overlap (`optim.check` includes
`safe.before_replay`); they say where the whole call's time goes, not a sum.
"""

from __future__ import annotations

import os
import sys
import timeit
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from replay_overhead import captured_demo_step

from ddpgraph.inputs.arguments import flatten_call


def timed(name: str, fn: Callable[[], Any], n: int = 3000) -> None:
    best = min(timeit.timeit(fn, number=n) / n * 1e6 for _ in range(7))
    print(f"{name:28s} {best:7.2f} us")


def main() -> None:
    step, _, x, y = captured_demo_step()
    captured = step._captured
    assert captured is not None and step._layout is not None
    leaves, spec = flatten_call((x, y), {})
    timed("whole call", lambda: step(x, y))
    timed("layout.check", step._layout.check)
    timed("optim.check", step._optim.check)
    timed("safe.before_replay", step._optim.before_replay)
    timed("after_replay", lambda: step._policy_after_replay(captured))
    timed("flatten_call", lambda: flatten_call((x, y), {}))
    timed("graph.replay", lambda: captured.graph.replay(leaves))
    timed("family.select", lambda: step._family.select(captured, leaves, spec))
    timed("policy_unserved", lambda: step._policy_unserved(captured, (x, y), {}, leaves, spec))
    step.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
