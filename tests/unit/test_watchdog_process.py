"""The watchdog's real actions, in child processes: ending a stuck process, raising in
the training thread, waiting for a checkpoint being written, refusing `torch.save`
after an abort, and freeing graphs before the process group when `close()` is forgotten.

Each child is tests/scenarios/watchdog_process.py; its replay never finishes (a stand-in
event), its timeout is 0.3 s. The subprocess timeout is only a guard against a hang.
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

SCRIPT = SCENARIOS / "watchdog_process.py"
pytestmark = pytest.mark.slow  # a child process that imports torch for each test


def run_mode(mode: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "result.json"
    env = torchrun_env()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), mode, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    result = json.loads(out.read_text()) if out.exists() else {}
    return proc, result


def test_a_training_thread_stuck_behind_the_replay_ends_the_process(tmp_path: Path) -> None:
    proc, result = run_mode("stuck", tmp_path)
    assert proc.returncode == EXIT_CODE, proc.stderr
    assert "[REPLAY_TIMED_OUT] `train_step`: replay 1 has not finished" in proc.stderr
    assert "ABORT CALLED" in proc.stderr
    assert f"ending the process with exit status {EXIT_CODE}" in proc.stderr
    assert result == {}  # it never got past the wait


def test_the_training_thread_raises_at_its_next_call_and_saves_are_refused(tmp_path: Path) -> None:
    proc, result = run_mode("raises", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert result["code"] == "REPLAY_TIMED_OUT"
    assert result["save_after"] == "REPLAY_TIMED_OUT"
    assert "ABORT CALLED" in proc.stderr


def test_a_checkpoint_being_written_completes_before_the_abort(tmp_path: Path) -> None:
    proc, result = run_mode("checkpoint", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert result["reported_while_saving"]  # the timeout fired during the save
    assert result["loads_equal"]
    assert result["bytes_at_abort"] == result["final_bytes"] > 0  # abort after the last byte
    assert result["code"] == "REPLAY_TIMED_OUT" and result["save_after"] == "REPLAY_TIMED_OUT"


def test_a_checkpoint_stuck_on_the_replay_ends_the_process_without_abort(tmp_path: Path) -> None:
    proc, result = run_mode("checkpoint_stuck", tmp_path)
    assert proc.returncode == EXIT_CODE, proc.stderr
    assert "still in `torch.save`" in proc.stderr
    assert "ABORT CALLED" not in proc.stderr
    assert result == {}


def test_a_forgotten_close_frees_the_graph_before_the_process_group(tmp_path: Path) -> None:
    proc, _ = run_mode("forgot_close", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "STATE captured replays=3" in proc.stdout
    assert proc.stdout.count("GRAPH RELEASED group_alive=True") == 1, proc.stdout


def test_shutdown_closes_live_steps_before_destroying_the_group(tmp_path: Path) -> None:
    proc, _ = run_mode("shutdown", tmp_path)
    assert proc.returncode == 0, proc.stderr
    released = proc.stdout.index("GRAPH RELEASED group_alive=True")
    assert released < proc.stdout.index("SHUT DOWN group_alive=False"), proc.stdout
    assert proc.stdout.count("GRAPH RELEASED") == 1  # not released again at exit
