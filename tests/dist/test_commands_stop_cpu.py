"""`ddpgraph demo` and `ddpgraph bench` interrupted with Ctrl-C leave no process of their
job running, close their output, and say so in one line.

A terminal's Ctrl-C goes to the foreground process group: the command, which starts
torchrun in a session of its own (its workers are in sessions of their own too). So the
test sends SIGINT to the command alone, once the job's workers run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpgraph.app.job import alive, job_processes
from launcher import torchrun_env
from shared_launches import prefetched

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not Path("/proc").is_dir(), reason="lists processes through /proc"),
]


HANG = str(
    Path(__file__).parent.parent / "doctor_scripts" / "cpu_hang.py"
)  # both ranks hang in a collective
# `python3 -m ddpgraph` with Python's Ctrl-C handler installed: a shell without job control
# (a script's `pytest &`, nohup) starts its children with SIGINT ignored, and Python then
# keeps it ignored, so the command would never see the SIGINT this test sends.
WITH_CTRL_C = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'ddpgraph'; runpy.run_module('ddpgraph', run_name='__main__', alter_sys=True)"
)


COMMANDS = {
    "demo": ["demo", "--cpu"],
    "bench": ["bench", "--cpu", "--model", "gpt"],
    "doctor": ["doctor", "--nproc", "2", "--timeout", "300", HANG],
}


def _interrupt(command: list[str]) -> tuple[int | None, str, list[int], list[int]]:
    """Start `ddpgraph COMMAND`, send it SIGINT once its job's workers run: its exit
    status, its standard error, the job's processes and those still alive after it ended."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WITH_CTRL_C, *command],
        env=torchrun_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    job: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            job = job_processes(proc.pid)
            if len(job) >= 4:  # the command, torchrun and its two workers
                break
            time.sleep(0.2)
        if len(job) < 4:
            return None, f"the job never had 4 processes: {job}", job, []
        time.sleep(3)  # the workers import torch and meet
        job = job_processes(proc.pid)
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)  # returns once nothing holds the pipes
        return proc.returncode, err, job, [p for p in job if alive(p)]
    finally:  # a failing run leaves nothing either
        for pid in [proc.pid, *job]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


# Each waits for its job to start, then for it to stop: run beside the other background
# runs (tests/shared_launches.py).
STOPPED = {
    name: prefetched(lambda command=command: _interrupt(command), waits=True)
    for name, command in COMMANDS.items()
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_ctrl_c_stops_the_whole_job_and_prints_one_line(name: str) -> None:
    returncode, err, job, left = STOPPED[name].result()
    assert returncode == 130, err[-3000:]
    assert left == [], job
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"ddpgraph{'' if name != 'doctor' else ' doctor'}: interrupted"), err[
        -3000:
    ]
