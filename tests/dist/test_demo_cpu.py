"""`ddpgraph demo --nproc 2` end to end on CPU: the plain command starts two gloo workers
through torchrun itself, trains three runs, and prints the table; the captured run uses the
CPU recording backend, labelled as an emulation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared_launches import prefetched_in

pytestmark = pytest.mark.multiprocess


def _run_demo(folder: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    script = Path(sys.executable).parent / ("ddpgraph.exe" if os.name == "nt" else "ddpgraph")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "ddpgraph"]
    json_path = folder / "demo.json"
    # A user's shell: not inside torchrun, no GPU even where the tests run on a GPU machine.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    }
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("OMP_NUM_THREADS", "1")
    env["COLUMNS"] = "160"  # one table row per line
    proc = subprocess.run(
        # --nproc as a user types it: it must not reach torchrun's own parser.
        [*command, "demo", "--nproc", "2", "--steps", "12", "--json", str(json_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    return proc, json_path


# Run in the background while other tests run (tests/shared_launches.py).
DEMO = prefetched_in("demo", _run_demo)


@pytest.fixture(scope="module")
def demo() -> tuple[subprocess.CompletedProcess[str], Path]:
    return DEMO.result()


def test_demo_exits_0(demo: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, _ = demo
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_demo_prints_the_table(demo: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    out = demo[0].stdout
    assert "ddpgraph demo: TinyGPT" in out
    assert "12 steps, 2 CPU processes (gloo)" in out
    for header in ("run", "ms/step", "speedup", "final loss"):
        assert header in out
    for run in ("eager DDP, default AdamW", "eager DDP, graph-safe AdamW", "capture_step"):
        assert run in out
    assert "Losses of capture_step and eager (same graph-safe AdamW) agree" in out


def test_demo_emulates_the_capture_and_says_so(
    demo: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    out = demo[0].stdout
    assert "capture_step (11 warm-up" in out and "1 replays)" in out
    assert "CPU emulation" in out and "not a GPU speed-up" in out
    assert "did not capture" not in out and "all three runs are eager" not in out


def test_demo_prints_once(demo: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    assert demo[0].stdout.count("ddpgraph demo: TinyGPT") == 1  # rank 0 only


def test_demo_json(demo: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    data = json.loads(demo[1].read_text())
    assert data["world_size"] == 2 and data["device"] == "cpu"
    assert [len(r["losses"]) for r in data["runs"]] == [12, 12, 12]
    # The replayed step equals the eager one with the same optimizer, bit for bit.
    assert data["max_abs_loss_diff_captured_vs_graph_safe_eager"] == 0.0
    assert data["param_rel_diff_captured_vs_graph_safe_eager"] == 0.0
    assert data["reason"] == ""
