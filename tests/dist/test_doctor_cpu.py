"""`ddpgraph doctor` end to end on CPU: torchrun with two gloo processes, the real
instrumented workers, the merged report and the exit status."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from doctor_scripts.expect import expectations, marked, run_doctor, script, summary
from processes import running
from shared_launches import prefetched

pytestmark = pytest.mark.multiprocess

PORTABLE = ["portable_graph.py", "cpu_capture_step_portable.py"]
FROZEN_SCRIPTS = [
    "cpu_frozen_counter.py",
    "cpu_frozen_ramp.py",
    "cpu_frozen_global.py",
    "cpu_frozen_flag.py",
]
# Each doctor run starts three processes that import PyTorch, and the hang waits out its
# limit: they run in the background while other tests run (tests/shared_launches.py), the
# hang beside the others since it mostly waits. The limit is long enough for both ranks
# to start and reach their lines on a loaded 2-core machine (about 5-8 s there) with the
# suite's other background runs beside it; waiting longer costs no CPU.
HANG_LIMIT_S = 40
# Their test is skipped where CUDA is: not run there.
_NO_CUDA_RUNS = [] if torch.cuda.is_available() else PORTABLE
RUNS = {
    "clean": prefetched(lambda: run_doctor("cpu_clean.py", "--steps", "3")),
    "fail": prefetched(lambda: run_doctor("cpu_fail.py")),
    "hang": prefetched(lambda: run_doctor("cpu_hang.py", timeout=HANG_LIMIT_S), waits=True),
    "nan": prefetched(lambda: run_doctor("cpu_nan_monitor.py")),
    "capture_step_clean": prefetched(lambda: run_doctor("cpu_capture_step_clean.py")),
    **{
        name: prefetched(lambda name=name: run_doctor(name))
        for name in _NO_CUDA_RUNS + FROZEN_SCRIPTS
    },
}


def marked_cpu(name: str) -> int | None:
    [expected] = expectations(name, gpu=False)
    return expected.line


def test_clean_script_reports_clean_and_passes_arguments() -> None:
    status, report, output = RUNS["clean"].result()
    assert status == 0, output[-3000:]
    assert report["status"] == "clean" and report["findings"] == []
    assert report["args"] == ["--steps", "3"]
    assert [r["status"] for r in report["ranks"]] == ["finished", "finished"]
    assert "step 2 loss" in output  # the script's own output, on stderr with --json
    assert all(r["doctor_errors"] == [] for r in report["ranks"])


def test_failing_script_is_reported_at_its_line_on_every_rank() -> None:
    status, report, output = RUNS["fail"].result()
    assert status == 1, output[-3000:]
    line = marked("cpu_fail.py")["SCRIPT_FAILED"][None]
    assert summary(report) == [("SCRIPT_FAILED", [0, 1], line)]
    assert "target batch_size" in report["findings"][0]["happened"]
    assert [r["status"] for r in report["ranks"]] == ["failed", "failed"]
    assert "Traceback" in output  # the script's traceback is still printed


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="lists processes through /proc")
def test_hanging_script_is_stopped_and_each_rank_located() -> None:
    # Both ranks hang in a collective, where no SIGTERM handler runs: the doctor still
    # leaves nothing running, and its output pipes close (run_doctor reads them to the end).
    status, report, output = RUNS["hang"].result()
    assert running(str(script("cpu_hang.py"))) == []
    assert status == 1, output[-3000:]
    assert report["timed_out"] is True
    lines = marked("cpu_hang.py")["SCRIPT_TIMED_OUT"]
    assert sorted(summary(report)) == [
        ("SCRIPT_TIMED_OUT", [0], lines[0]),
        ("SCRIPT_TIMED_OUT", [1], lines[1]),
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("name", PORTABLE)
def test_without_a_gpu_nothing_is_checked_and_the_doctor_says_so(name: str) -> None:
    # portable_graph.py dies in torch.cuda.CUDAGraph() (the stand-in class of a CPU
    # build); cpu_capture_step_portable.py runs to the end, its capture_step eagerly.
    status, report, output = RUNS[name].result()
    assert status == 3, output[-3000:]
    assert report["status"] == "unchecked"
    line = marked_cpu(name)
    assert summary(report) == [("NO_CUDA", [0, 1], line)], report["findings"]
    assert report["findings"][0]["happened"].startswith(
        "nothing was checked because there is no GPU"
    )


def test_a_non_finite_loss_seen_by_ddpgraphs_monitor() -> None:
    status, report, output = RUNS["nan"].result()
    assert status == 1, output[-3000:]
    line = marked("cpu_nan_monitor.py")["NON_FINITE_LOSS"][None]
    assert summary(report) == [("NON_FINITE_LOSS", [0, 1], line)]


@pytest.mark.parametrize("name", FROZEN_SCRIPTS)
def test_a_frozen_python_value_is_named_at_its_line(name: str) -> None:
    """With the recording backend, whose replays run no Python: a counter, a ramp and a
    global found in the warm-up, a flag flipped after capture by the check the doctor
    turns on."""
    status, report, output = RUNS[name].result()
    assert status == 1, output[-3000:]
    line = marked(name)["FROZEN_PYTHON_VALUE"][None]
    assert summary(report) == [("FROZEN_PYTHON_VALUE", [0, 1], line)], report["findings"]


def test_a_correct_capture_step_loop_stays_clean_under_the_checks() -> None:
    status, report, output = RUNS["capture_step_clean"].result()
    assert status == 0, output[-3000:]
    assert report["findings"] == [] and "step 30 loss" in output
