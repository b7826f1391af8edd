"""The tests' own launching (tests/launcher.py): a job of several torchrun agents ends
when one of them fails, rather than at its time limit."""

from __future__ import annotations

import subprocess
import sys
import time

from launcher import wait_for_nodes


def _python(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_the_other_agents_are_ended_soon_after_one_fails() -> None:
    waiting = _python("import time; print('started', flush=True); time.sleep(60)")
    failed = _python("import sys; print('failed'); sys.exit(1)")
    started = time.monotonic()
    logs = wait_for_nodes([waiting, failed], timeout=60, grace=0.5)
    assert time.monotonic() - started < 30
    assert waiting.returncode != 0 and failed.returncode == 1
    assert logs[0][0] == "started\n" and logs[0][1].endswith("(node 0 killed: still running)")
    assert logs[1] == ("failed\n", "")


def test_agents_that_succeed_are_waited_for() -> None:
    slow = _python("import time; time.sleep(1); print('done')")
    quick = _python("print('done')")
    logs = wait_for_nodes([slow, quick], timeout=60, grace=0.1)
    assert (slow.returncode, quick.returncode) == (0, 0)
    assert logs == [("done\n", ""), ("done\n", "")]
