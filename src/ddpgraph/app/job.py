"""The processes of one torchrun job, and stopping every one of them.

torchrun starts each worker in a session of its own (its elastic subprocess handler
passes `start_new_session=True`), so a signal to torchrun's process group never reaches
the workers, and a worker blocked in a collective does not run its Python SIGTERM
handler: stopping torchrun alone leaves the workers alive, re-parented to PID 1, holding
the job's output pipes open. So the job's processes are collected while torchrun is
still their parent (torchrun, its workers, and what the workers started: DataLoader
workers), and each one's process group is signalled: SIGTERM, then SIGKILL for what is
left after a grace period.

A command that starts a job (`run_job`) starts torchrun in a session of its own, so a
Ctrl-C in the terminal reaches the command alone, which stops the job and says so in
one line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

INTERRUPTED_EXIT = 130  # what a shell reports for a command ended by Ctrl-C
_PROC = Path("/proc")


def _parents() -> dict[int, int]:
    """Every process's parent: from /proc where there is one, else from `ps`."""
    parents: dict[int, int] = {}
    if _PROC.is_dir():
        for entry in _PROC.iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    # The command name, in parentheses, may hold spaces: read after it.
                    stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                    parents[int(entry.name)] = int(stat[1])
        return parents
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, check=False
        ).stdout
        for line in out.splitlines():
            pid, ppid = line.split()
            parents[int(pid)] = int(ppid)
    return parents


def job_processes(root: int) -> list[int]:
    """`root` and all its descendants, parents first."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    found, queue = [], [root]
    while queue:
        pid = queue.pop(0)
        found.append(pid)
        queue.extend(children.get(pid, []))
    return found


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, ended but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        return (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _signal(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            group = os.getpgid(pid)
            if group != os.getpgrp():  # never this command's own group
                os.killpg(group, sig)
                continue
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def stop_job(
    proc: subprocess.Popen[bytes] | subprocess.Popen[str],
    grace_s: float = 15.0,
    *,
    quiet: bool = False,
) -> int:
    """Stop torchrun (`proc`) and every process of its job; return how many there were.

    SIGTERM to each one's process group first (the doctor's workers write their records
    on it), SIGKILL to what is still running `grace_s` later. `quiet` ends torchrun with
    SIGKILL at once, so that it prints no report of the workers it would see end."""
    pids = job_processes(proc.pid)
    if quiet:
        _signal([proc.pid], signal.SIGKILL)
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
    left = [p for p in pids if alive(p)]
    if left:
        _signal(left, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    return len(pids)


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM to this command (a scheduler ending it) raises SystemExit, so that the job
    is stopped with it instead of being left behind."""

    def exit_now(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, exit_now)
    except ValueError:  # not the main thread: signals are not ours to take
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_job(command: Sequence[str], env: dict[str, str]) -> int:
    """Run the torchrun `command` to its end and return its exit status. On Ctrl-C, stop
    the whole job, say so in one line, and return INTERRUPTED_EXIT."""
    proc = subprocess.Popen(list(command), env=env, start_new_session=True)
    try:
        with _terminate_as_exit():
            return proc.wait()
    except KeyboardInterrupt:
        count = stop_job(proc, grace_s=5.0, quiet=True)
        print(
            f"ddpgraph: interrupted; stopped the job's {count} processes.",
            file=sys.stderr,
            flush=True,
        )
        return INTERRUPTED_EXIT
    except BaseException:
        stop_job(proc, grace_s=5.0, quiet=True)
        raise
