"""One doctored rank (`ddpgraph.doctor.worker`) stopped by torchrun's SIGTERM: a rank
that has already failed keeps its failure in its record, and a rank that was still
running is recorded as terminated."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpgraph.doctor.records import DIR_VARIABLE, RankStatus, read_records
from ddpgraph.doctor.worker import PEER_WAIT_VARIABLE
from doctor_scripts.expect import env as doctor_env

# slow: each test starts a rank, a child process that imports torch.
pytestmark = [
    pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="needs POSIX signals"),
    pytest.mark.slow,
]

FAILING = "raise ValueError('target batch_size 3 does not match input batch_size 4')\n"
SLEEPING = "import time\ntime.sleep(60)\n"


def start_rank(tmp_path: Path, source: str) -> tuple[subprocess.Popen[bytes], Path]:
    script = tmp_path / "train.py"
    script.write_text(source)
    records = tmp_path / "records"
    records.mkdir()
    env = {
        **doctor_env(),
        DIR_VARIABLE: str(records),
        "RANK": "0",
        "WORLD_SIZE": "2",  # rank 1 never hands in a record, so a failed rank 0 waits for it
        PEER_WAIT_VARIABLE: "60",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpgraph.doctor.worker", str(script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return proc, records


def wait_for_status(proc: subprocess.Popen[bytes], records: Path, status: RankStatus) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if read_records(records, 2)[0].status is status:
            return
        assert proc.poll() is None, proc.communicate()[0].decode()[-2000:]
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"rank 0 never recorded {status.value}")


def test_sigterm_after_the_script_failed_keeps_the_failure(tmp_path: Path) -> None:
    proc, records = start_rank(tmp_path, FAILING)
    wait_for_status(proc, records, RankStatus.FAILED)
    proc.send_signal(signal.SIGTERM)  # what torchrun does once another rank has exited
    output = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 1, output[-2000:]
    record = read_records(records, 2)[0]
    assert record.status is RankStatus.FAILED
    assert record.exit_code == 1
    assert [f.code.name for f in record.findings] == ["SCRIPT_FAILED"]


def test_sigterm_while_the_script_runs_records_termination(tmp_path: Path) -> None:
    proc, records = start_rank(tmp_path, SLEEPING)
    wait_for_status(proc, records, RankStatus.RUNNING)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    record = read_records(records, 2)[0]
    assert record.status is RankStatus.TERMINATED
    assert record.exit_code == 128 + signal.SIGTERM
