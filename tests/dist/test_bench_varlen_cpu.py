"""`ddpgraph bench --seq-lens` end to end on two CPU processes (gloo), as a user types it:
the eager rows run, the capture_step rows run emulated (the recording backend), with a
family of graphs for the buckets, and the GPU-only rows are skipped with a reason.

The command is the one docs/benchmarks.md shows for it (its block is marked `run-by` this
file): this module runs it as typed, so the documentation's test need not run it again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpgraph.bench import validate
from doc_blocks import run_by
from launcher import torchrun_env
from shared_launches import prefetched_in

pytestmark = pytest.mark.multiprocess

[BLOCK] = run_by("tests/dist/test_bench_varlen_cpu.py")
[COMMAND] = BLOCK.commands()


def _run_command(out: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]:
    assert (
        COMMAND.startswith("ddpgraph bench --cpu --seq-lens 8:32")
        and "--plot varlen.png" in COMMAND
    )
    env = torchrun_env()
    # A user's shell: the environment's `ddpgraph` command, and no GPU even on a GPU machine
    # (two CPU processes, the default without CUDA).
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        ["bash", "-c", COMMAND],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    (out / "bench.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads((out / "varlen.json").read_text()), out


# Run in the background while other tests run (tests/shared_launches.py).
BENCH = prefetched_in("bench_varlen", _run_command)


@pytest.fixture(scope="module")
def run() -> tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]:
    return BENCH.result()


def _rows(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["strategy"]: r for r in data["results"]}


def test_json_records_the_case(run: Any) -> None:
    _, data, _ = run
    assert validate(data) == []
    setup = data["setup"]
    assert (setup["world_size"], setup["backend"], setup["cuda"]) == (2, "gloo", None)
    case = setup["settings"]["variable_lengths"]
    assert (
        case["seq_lens"] == [8, 32] and case["buckets"] == [16, 24, 32] and case["fixed_len"] == 20
    )
    assert "ignore_index" in case["padding"]
    assert setup["settings"]["strategies"] == list(case["families"])  # the rows' families
    assert list(_rows(data)) == [
        "eager",
        "reduce-overhead",
        "reduce-overhead dynamic=True",
        "whole",
        "whole+buckets",
        "compile+buckets",
        "eager T=20",
        "whole T=20",
        "whole+buckets T=32 alone",
    ]


def test_eager_and_emulated_rows_run_and_train_alike(run: Any) -> None:
    _, data, _ = run
    rows = _rows(data)
    eager = rows["eager"]
    for name in (
        "eager",
        "whole",
        "whole+buckets",
        "eager T=20",
        "whole T=20",
        "whole+buckets T=32 alone",
    ):
        assert rows[name]["status"] == "ok", rows[name]["reason"]
        assert (
            len(rows[name]["feeds"]["device"]["window_ms"]) == 1
            and "dataloader" not in rows[name]["feeds"]
        )
    # The same lengths in the same order, padding out of the loss: the same last loss
    # (the emulated rows' fused AdamW rounds differently from eager's: same math, not bits).
    for name in ("whole", "whole+buckets"):
        assert rows[name]["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-5), name
    assert rows["whole T=20"]["final_loss"] == pytest.approx(
        rows["eager T=20"]["final_loss"], rel=1e-5
    )
    for name in ("reduce-overhead", "reduce-overhead dynamic=True", "compile+buckets"):
        assert rows[name]["status"] == "skipped" and rows[name]["reason"], name


def test_the_bucketed_row_holds_a_family_of_graphs(run: Any) -> None:
    _, data, _ = run
    rows = _rows(data)
    family = rows["whole+buckets"]["varlen"]
    assert 2 <= family["graphs_held"] <= 3 and family["captures"] == family["graphs_held"], family
    assert family["pool_mib"] is None  # no CUDA pool on CPU
    single = rows["whole"]["varlen"]
    assert single["graphs_held"] == 1 and single["eager_steps"] > family["eager_steps"], (
        single,
        family,
    )
    assert rows["whole+buckets"]["note"].startswith("CPU emulation")


def test_table_summary_and_plot_say_what_ran(run: Any) -> None:
    proc, data, out = run
    assert "variable sequence lengths" in proc.stdout and "No CUDA here" in proc.stdout
    assert "whole+buckets against its targets" in proc.stdout and "not on CPU" in proc.stdout
    (summary,) = data["summary"]
    assert summary["judged"] is False and summary["share_target_met"] is None
    assert "| 4 | whole+buckets | 8:32 → 16,24,32 |" in data["markdown"]
    assert (out / "varlen.png").read_bytes()[:4] == b"\x89PNG"
    # The one-graph row's eager calls are the design, counted in its row: no raw warning.
    assert "INPUT_SIGNATURE_CHANGED" not in proc.stdout + proc.stderr
