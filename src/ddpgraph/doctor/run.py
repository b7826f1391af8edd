"""Running a script under torchrun with the doctor's workers, within a time limit.

torchrun stays the launcher: the doctor starts it with `-m ddpgraph.doctor.worker` in
place of the script, in a session of its own, and stops the whole job (torchrun, its
workers, their children: `app.job`) when the time runs out or the doctor is interrupted.
Before stopping a job that ran out of time, it asks every rank still running for its
Python stacks (faulthandler, which answers even from inside a collective), so the report
can say where each rank was waiting.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from ..app.job import stop_job
from ..app.launch import torchrun_command
from ..ddp.process import cuda_available
from ..findings import Location
from ..probe.code_origin import location_of, user_frame
from .records import DIR_VARIABLE, RankRecord, RankStatus, read_records, stack_dump_path

_STACK_WAIT_S = 1.5
# A rank that has not ended this long after SIGTERM is stuck where no handler runs.
_STOP_WAIT_S = 5.0
_FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+) in (?P<name>.+)$')


@dataclass
class RunResult:
    records: list[RankRecord]
    exit_code: int | None  # torchrun's
    timed_out: bool
    elapsed_s: float
    # Where each rank still running was when the time ran out.
    stuck_at: dict[int, Location | None] = field(default_factory=dict)


def worker_command(script: str, args: list[str], nproc: int) -> list[str]:
    return torchrun_command([script, *args], nproc, "ddpgraph.doctor.worker")


def run_script(
    script: str, args: list[str], *, nproc: int, timeout_s: float, quiet_stdout: bool
) -> RunResult:
    """Run `script` in `nproc` instrumented ranks and collect their records.

    `quiet_stdout` sends the script's standard output to standard error, so that the
    doctor's own standard output carries only its report (for `--json`).
    """
    directory = tempfile.mkdtemp(prefix="ddpgraph-doctor-")
    env = dict(os.environ)
    env[DIR_VARIABLE] = directory
    env.setdefault("PYTHONUNBUFFERED", "1")
    if not cuda_available():
        # Two CPU workers on a small machine fight over cores with PyTorch's default threads.
        env.setdefault("OMP_NUM_THREADS", "1")
    start = time.monotonic()
    stuck_at: dict[int, Location | None] = {}
    timed_out = False
    try:
        proc = subprocess.Popen(
            worker_command(script, args, nproc),
            env=env,
            stdout=_stderr_fd() if quiet_stdout else None,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            stuck_at = _ask_for_stacks(directory, nproc, script)
            stop_job(proc, _STOP_WAIT_S)
        except BaseException:  # Ctrl-C: the job goes too, and torchrun reports nothing
            stop_job(proc, _STOP_WAIT_S, quiet=True)
            raise
        records = read_records(directory, nproc)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return RunResult(records, proc.returncode, timed_out, time.monotonic() - start, stuck_at)


def _ask_for_stacks(directory: str, nproc: int, script: str) -> dict[int, Location | None]:
    running = [
        r for r in read_records(directory, nproc) if r.status is RankStatus.RUNNING and r.pid
    ]
    for record in running:
        with contextlib.suppress(OSError, AttributeError):
            os.kill(record.pid, signal.SIGUSR1)
    if running:
        time.sleep(_STACK_WAIT_S)
    found: dict[int, Location | None] = {}
    for record in running:
        try:
            text = stack_dump_path(directory, record.rank).read_text()
        except OSError:
            text = ""
        found[record.rank] = waiting_location(text, script)
    return found


def waiting_location(dump: str, script: str) -> Location | None:
    """The user's line in a faulthandler dump, preferring the script's own file.

    faulthandler lists each thread's frames most recent first; the thread running the
    script is the one with the script's frames.
    """
    target = os.path.abspath(script)
    best: Location | None = None
    for block in re.split(r"\n\s*\n", dump):
        frames = []
        for line in block.splitlines():
            match = _FRAME.match(line)
            if match:
                frames.append(
                    traceback.FrameSummary(match["file"], int(match["line"]), match["name"])
                )
        where = location_of(user_frame(frames[::-1]))
        if where is None:
            continue
        if os.path.abspath(where.filename) == target:
            return where
        best = best or where
    return best


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return 2


def script_exists(script: str) -> bool:
    return Path(script).is_file()
