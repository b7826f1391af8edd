"""mypy over the package, started in the background when the session has collected its
test (tests/unit/test_code_quality.py), so that its half-minute of CPU fills the time the
multi-process tests spend waiting rather than adding to the suite's.

It runs at a low priority while other tests run, so that it takes mostly CPU they leave
unused; once its test waits for it, it gets the normal priority back where the system lets
a process raise it (as root), since nothing of the suite competes with it then. Its cache
is mypy's own (.mypy_cache, as `mypy` makes it).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_running: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}


_LOW_PRIORITY = 10


def _low_priority() -> None:
    os.nice(_LOW_PRIORITY)


def start_mypy() -> None:
    """Start `python -m mypy` in the repository (as configured in pyproject.toml), once."""
    if "mypy" in _running:
        return
    fd, name = tempfile.mkstemp(prefix="ddpgraph-mypy-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mypy"],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_low_priority if hasattr(os, "nice") else None,
        )
    _running["mypy"] = (proc, Path(name))


def mypy_result(timeout: float = 900) -> tuple[int, str]:
    """mypy's exit status and output; starts it first if nothing did."""
    start_mypy()
    proc, log = _running["mypy"]
    if proc.poll() is None and hasattr(os, "setpriority"):
        # A machine busy with other work would otherwise leave the niced mypy little CPU.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, proc.pid, 0)
    returncode = proc.wait(timeout=timeout)
    return returncode, log.read_text(errors="replace")


def stop() -> None:
    """At the session's end: a mypy nobody waited for (its test failed to run) goes."""
    for proc, log in _running.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.unlink(missing_ok=True)
    _running.clear()
