"""mypy over the package, started in the background as the session starts, before
collection, where the session may select its test (tests/unit/test_code_quality.py), and
stopped if it did not: collection keeps one core busy for some seconds, and mypy, the
longest single job, takes the other; its half-minute of CPU then fills time that the
other tests leave rather than adding to the suite's.

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
TEST_FILE = REPO / "tests" / "unit" / "test_code_quality.py"
_running: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}


_LOW_PRIORITY = 10


def _low_priority() -> None:
    os.nice(_LOW_PRIORITY)


def may_run(args: list[str], markexpr: str) -> bool:
    """Whether a session of these arguments may select mypy's test: before collection, a
    path among `args` holds its file and the mark expression does not leave out `slow`."""
    if "not slow" in markexpr:
        return False
    for arg in args:
        path = Path(arg.split("::", 1)[0]).resolve()
        if path == TEST_FILE or path in TEST_FILE.parents:
            return True
    return False


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
    """A mypy nobody will wait for goes: once collected, where its test was not selected;
    at the session's end, where its test failed to run."""
    for proc, log in _running.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.unlink(missing_ok=True)
    _running.clear()
