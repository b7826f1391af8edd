"""What the replay watchdog costs the training thread per replay, in microseconds.

    python scripts/bench_watchdog.py            # CPU: the Python part (stand-in event)
    python scripts/bench_watchdog.py --cuda     # GPU: a real CUDA event recorded per replay

Measures `ReplayWatchdog.after_replay` (event from the spare list, record, append to the
queue) against an empty call, with the watchdog thread running as in training. On CUDA
each timed call follows a tiny kernel, so events are recorded behind real work; the
thread retires them. A measurement, printed; not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ddpgraph.agreement.peers import NoBoard
from ddpgraph.watchdog.watch import FinishedEvent, ReplayWatchdog


def per_call_us(fn, n: int, before=None) -> float:  # type: ignore[no-untyped-def]
    """Median over 5 rounds of the mean time of `fn()`, excluding `before()`."""
    rounds = []
    for _ in range(5):
        total = 0.0
        for _ in range(n):
            if before is not None:
                before()
            start = time.perf_counter_ns()
            fn()
            total += time.perf_counter_ns() - start
        rounds.append(total / n / 1000)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true", help="record real CUDA events")
    parser.add_argument("-n", type=int, default=20_000, help="calls per round")
    args = parser.parse_args()
    device = torch.device("cuda") if args.cuda else torch.device("cpu")
    factory = torch.cuda.Event if args.cuda else FinishedEvent
    watchdog = ReplayWatchdog(
        600.0, "report", "bench", device=device, event_factory=factory, board=NoBoard()
    )
    work = torch.zeros(1, device=device)
    before = (lambda: work.add_(1)) if args.cuda else None
    baseline = per_call_us(lambda: None, args.n, before)
    watched = per_call_us(watchdog.after_replay, args.n, before)
    if args.cuda:
        torch.cuda.synchronize()
    time.sleep(3 * watchdog.poll_s)
    print(f"device: {torch.cuda.get_device_name() if args.cuda else 'cpu (stand-in event)'}")
    print(f"empty call:               {baseline:7.2f} us")
    print(f"after_replay:             {watched:7.2f} us")
    print(f"watchdog cost per replay: {watched - baseline:7.2f} us")
    print(f"pending after the run:    {len(watchdog._pending)} (retired by the thread)")
    watchdog.close()


if __name__ == "__main__":
    main()
