"""A rank that stops calling the captured step: the others report and fail, not hang.

torchrun + gloo on CPU, the stand-in backend, and a stand-in event that finishes once
every rank launched the replay (tests/scenarios/cpu_watchdog.py). The last rank stops
after 3 replays; every other rank's replay 4 then never finishes. The subprocess timeout
only guards against a hang: the job must end because the watchdog fails it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from launcher import torchrun_command, torchrun_env
from shared_launches import prefetched_in

pytestmark = pytest.mark.multiprocess


def _launch(nproc: int, out: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    cmd = torchrun_command(
        ["--standalone", f"--nproc_per_node={nproc}"], "cpu_watchdog.py", out, []
    )
    proc = subprocess.run(
        cmd, env=torchrun_env(), capture_output=True, text=True, timeout=140, check=False
    )
    return proc, out


# The job waits out the watchdog's limit: run beside the other background runs
# (tests/shared_launches.py).
LAUNCHES = {
    n: prefetched_in(f"watchdog_{n}proc", lambda out, n=n: _launch(n, out), waits=True)
    for n in (2, 4)
}


@pytest.mark.parametrize("nproc", [2, 4])
def test_the_waiting_ranks_report_the_stopped_one_and_the_job_ends(nproc: int) -> None:
    proc, tmp_path = LAUNCHES[nproc].result()
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log  # a rank failed, so the job did
    assert not (tmp_path / "stopper_woke").exists(), "torchrun did not end the stopped rank"
    stopper = nproc - 1
    stopped = json.loads((tmp_path / f"watchdog.rank{stopper}.json").read_text())
    assert stopped["stopped_after_replays"] == 3
    reports = [
        json.loads(p.read_text())
        for r in range(stopper)
        if (p := tmp_path / f"watchdog.rank{r}.json").exists()
    ]
    # The first rank to fail ends the job; the others may be ended before they write.
    assert reports, log
    for report in reports:
        assert report["code"] == "REPLAY_TIMED_OUT", report
        message = report["message"]
        assert "`square_loss_step.<locals>.train_step`: replay 4 has not finished after" in message
        assert ", 3 finished);" in message  # this rank's own counts
        # Sorted fewest launched first: the stopped rank leads the list of the others.
        others = message.split("finished); ")[1]
        # Its calls too: 3 warm-up calls (a model without DDP) and the 3 replays.
        assert others.startswith(
            f"rank {stopper} made 6 calls and launched 3 replays, 3 finished"
        ), message
        assert f"[rank {report['rank']}]" in message
    assert "[REPLAY_TIMED_OUT]" in log  # also on stderr, for a job whose log is all there is
