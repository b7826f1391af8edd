"""The replay watchdog with real CUDA graphs and NCCL (tests/scenarios/gpu_watchdog.py).

Each mode runs in its own process: an abort leaves that process's communicator unusable.
A replay is made late by a `torch.cuda._sleep` queued ahead of it on its stream. The
subprocess timeouts guard against hangs; no timing is asserted. The measured latency
from the late replay's launch to the report is printed against the stated bound
(timeout 2 s + 1 s margin: one poll interval is 0.04 s).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpgraph.watchdog.watch import EXIT_CODE
from launcher import SCENARIOS, torchrun_env

pytestmark = pytest.mark.gpu
SCRIPT = SCENARIOS / "gpu_watchdog.py"


def run(
    mode: str, out: Path, timeout: float = 240
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    env = torchrun_env()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), mode, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    path = out / f"{mode}.rank0.json"
    return proc, json.loads(path.read_text()) if path.exists() else {}


def test_late_replay_is_reported_and_aborted_while_the_gpu_is_still_busy(tmp_path: Path) -> None:
    proc, r = run("late_abort", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert r["raised"] == "REPLAY_TIMED_OUT", r
    assert f"replay {r['replays_before'] + 1} has not finished after" in r["message"]
    assert "no other ranks in the process group" in r["message"]
    assert r["gpu_busy_at_report"]  # the report came from the timeout, not from the work ending
    assert r["aborted_with"] not in ("", "nothing to abort"), r
    assert "[REPLAY_TIMED_OUT]" in proc.stderr and "aborted the process group" in proc.stderr
    within = "within" if r["reported_after_s"] <= r["stated_bound_s"] else "OUTSIDE"
    print(
        f"report {r['reported_after_s']:.2f} s after the late launch (bound "
        f"{r['stated_bound_s']} s: {within}); abort returned at {r['aborted_after_s']:.2f} s "
        f"via {r['aborted_with']}"
    )


def test_a_training_thread_stuck_behind_the_late_replay_is_ended(tmp_path: Path) -> None:
    proc, r = run("stuck", tmp_path)
    assert proc.returncode == EXIT_CODE, proc.stdout + proc.stderr
    assert "BLOCKING IN ITEM" in proc.stdout
    assert "[REPLAY_TIMED_OUT]" in proc.stderr
    assert f"ending the process with exit status {EXIT_CODE}" in proc.stderr
    assert r == {}  # `.item()` never returned: the GPU sleeps 60 s, the process ended first
    # NCCL's abort may itself wait for the sleeping device; the exit deadline does not.
    print("abort returned before the exit:", "aborted the process group" in proc.stderr)


def test_report_policy_logs_and_training_goes_on(tmp_path: Path) -> None:
    proc, r = run("report", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert r["reported"] == ["REPLAY_TIMED_OUT"] and r["state"] == "captured"
    assert "[REPLAY_TIMED_OUT]" in proc.stderr


@pytest.mark.parametrize("mode", ["close_then_destroy", "forgot_close"])
def test_graphs_are_freed_before_the_process_group_and_exit_does_not_hang(
    mode: str, tmp_path: Path
) -> None:
    proc, r = run(mode, tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"DONE {mode}" in proc.stdout
    assert r["state"] == ("closed" if mode == "close_then_destroy" else "captured")
    print(f"{mode}: NCCL {r['nccl']}, exited cleanly")


@pytest.mark.two_ranks
def test_two_gpus_a_rank_that_stops_calling_makes_the_other_fail_with_the_report(
    tmp_path: Path,
) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(SCRIPT), "peer_stops", str(tmp_path)]
    proc = subprocess.run(
        cmd, env=torchrun_env(), capture_output=True, text=True, timeout=240, check=False
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log
    assert not (tmp_path / "stopper_woke").exists(), "torchrun did not end the stopped rank"
    stopped = json.loads((tmp_path / "peer_stops.rank1.json").read_text())
    assert "[REPLAY_TIMED_OUT]" in log, log
    assert f"rank 1 launched {stopped['stopped_after_replays']} replays" in log, log
    rank0 = tmp_path / "peer_stops.rank0.json"
    if rank0.exists():  # the abort gave the training thread back: it raised
        print("rank 0 raised:", json.loads(rank0.read_text())["raised"])
    else:
        assert f"exit status {EXIT_CODE}" in log, log
        print("rank 0 was ended by the watchdog after the abort")
