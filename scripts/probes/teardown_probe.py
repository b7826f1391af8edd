"""Does tearing down NCCL with a live CUDA graph hang here? One GPU, about 2 minutes.

    python scripts/probes/teardown_probe.py

Runs tests/scenarios/gpu_watchdog.py in three modes, each in its own process with a
90 s limit, and prints a PASS/FAIL table:

- close_then_destroy: `step.close()` then `destroy_process_group()` (the documented order)
- forgot_close: neither, the interpreter exits (ddpgraph's exit hook frees the graph)
- destroy_without_close: `destroy_process_group()` with the graph alive; NCCL >= 2.26 is
  said to wait for graphs that reference the communicator, so this may hang (HANG is
  what it measures, not a ddpgraph failure).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tests" / "scenarios" / "gpu_watchdog.py"
MODES = ["close_then_destroy", "forgot_close", "destroy_without_close"]


def main() -> int:
    rows = []
    for mode in MODES:
        with tempfile.TemporaryDirectory() as out:
            start = time.monotonic()
            try:
                proc = subprocess.run(
                    [sys.executable, str(SCRIPT), mode, out],
                    capture_output=True,
                    text=True,
                    timeout=90,
                    check=False,
                )
                outcome = (
                    "PASS" if proc.returncode == 0 and f"DONE {mode}" in proc.stdout else "FAIL"
                )
                detail = f"exit {proc.returncode}"
                if outcome == "FAIL":
                    detail += ": " + (proc.stderr.strip().splitlines() or [""])[-1][:80]
            except subprocess.TimeoutExpired:
                outcome, detail = "HANG", "no exit within 90 s"
            rows.append((mode, outcome, f"{time.monotonic() - start:.1f} s", detail))
    print(f"{'mode':<24} {'result':<6} {'time':>8}  detail")
    for mode, outcome, took, detail in rows:
        print(f"{mode:<24} {outcome:<6} {took:>8}  {detail}")
    return 0 if all(r[1] == "PASS" for r in rows[:2]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
