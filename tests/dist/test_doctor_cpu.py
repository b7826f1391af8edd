"""`ddpgraph doctor` end to end on CPU: torchrun with two gloo processes, the real
instrumented workers, the merged report and the exit status."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from doctor_scripts.expect import expectations, marked, run_doctor, script, summary
from processes import running

pytestmark = pytest.mark.multiprocess


def marked_cpu(name: str) -> int | None:
    [expected] = expectations(name, gpu=False)
    return expected.line


def test_clean_script_reports_clean_and_passes_arguments() -> None:
    status, report, output = run_doctor("cpu_clean.py", "--steps", "3")
    assert status == 0, output[-3000:]
    assert report["status"] == "clean" and report["findings"] == []
    assert report["args"] == ["--steps", "3"]
    assert [r["status"] for r in report["ranks"]] == ["finished", "finished"]
    assert "step 2 loss" in output  # the script's own output, on stderr with --json
    assert all(r["doctor_errors"] == [] for r in report["ranks"])


def test_failing_script_is_reported_at_its_line_on_every_rank() -> None:
    status, report, output = run_doctor("cpu_fail.py")
    assert status == 1, output[-3000:]
    line = marked("cpu_fail.py")["SCRIPT_FAILED"][None]
    assert summary(report) == [("SCRIPT_FAILED", [0, 1], line)]
    assert "target batch_size" in report["findings"][0]["happened"]
    assert [r["status"] for r in report["ranks"]] == ["failed", "failed"]
    assert "Traceback" in output  # the script's traceback is still printed


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="lists processes through /proc")
def test_hanging_script_is_stopped_and_each_rank_located() -> None:
    # Long enough for both ranks to start and reach their lines on a loaded 2-core machine
    # (about 5-8 s there); the test waits out the whole limit. Both ranks hang in a
    # collective, where no SIGTERM handler runs: the doctor still leaves nothing running,
    # and its output pipes close (run_doctor reads them to the end).
    status, report, output = run_doctor("cpu_hang.py", timeout=25)
    assert running(str(script("cpu_hang.py"))) == []
    assert status == 1, output[-3000:]
    assert report["timed_out"] is True
    lines = marked("cpu_hang.py")["SCRIPT_TIMED_OUT"]
    assert sorted(summary(report)) == [
        ("SCRIPT_TIMED_OUT", [0], lines[0]),
        ("SCRIPT_TIMED_OUT", [1], lines[1]),
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("name", ["portable_graph.py", "cpu_capture_step_portable.py"])
def test_without_a_gpu_nothing_is_checked_and_the_doctor_says_so(name: str) -> None:
    # portable_graph.py dies in torch.cuda.CUDAGraph() (the stand-in class of a CPU
    # build); cpu_capture_step_portable.py runs to the end, its capture_step eagerly.
    status, report, output = run_doctor(name)
    assert status == 3, output[-3000:]
    assert report["status"] == "unchecked"
    line = marked_cpu(name)
    assert summary(report) == [("NO_CUDA", [0, 1], line)], report["findings"]
    assert report["findings"][0]["happened"].startswith("nothing was checked because there is no GPU")


def test_a_non_finite_loss_seen_by_ddpgraphs_monitor() -> None:
    status, report, output = run_doctor("cpu_nan_monitor.py")
    assert status == 1, output[-3000:]
    line = marked("cpu_nan_monitor.py")["NON_FINITE_LOSS"][None]
    assert summary(report) == [("NON_FINITE_LOSS", [0, 1], line)]


FROZEN_SCRIPTS = ["cpu_frozen_counter.py", "cpu_frozen_ramp.py", "cpu_frozen_global.py", "cpu_frozen_flag.py"]


@pytest.mark.parametrize("name", FROZEN_SCRIPTS)
def test_a_frozen_python_value_is_named_at_its_line(name: str) -> None:
    """With the recording backend, whose replays run no Python: a counter, a ramp and a
    global found in the warm-up, a flag flipped after capture by the check the doctor
    turns on."""
    status, report, output = run_doctor(name)
    assert status == 1, output[-3000:]
    line = marked(name)["FROZEN_PYTHON_VALUE"][None]
    assert summary(report) == [("FROZEN_PYTHON_VALUE", [0, 1], line)], report["findings"]


def test_a_correct_capture_step_loop_stays_clean_under_the_checks() -> None:
    status, report, output = run_doctor("cpu_capture_step_clean.py")
    assert status == 0, output[-3000:]
    assert report["findings"] == [] and "step 30 loss" in output
