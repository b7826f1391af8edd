"""For the tests: run `ddpgraph doctor --json` on a script here, and read the lines its
`# doctor: CODE [rank N]` comments mark."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
REPO = HERE.parent.parent
_MARK = re.compile(r"#\s*doctor:\s*(?P<code>[A-Z_]+)(?:\s+rank\s+(?P<rank>\d+))?")


def script(name: str) -> Path:
    return HERE / name


def marked(name: str) -> dict[str, dict[int | None, int]]:
    """{code: {rank or None: line}} for the `# doctor:` comments of script `name`."""
    found: dict[str, dict[int | None, int]] = {}
    for number, line in enumerate(script(name).read_text().splitlines(), start=1):
        match = _MARK.search(line)
        if match:
            rank = int(match["rank"]) if match["rank"] else None
            found.setdefault(match["code"], {})[rank] = number
    return found


def env() -> dict[str, str]:
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), environ.get("PYTHONPATH", "")])
    environ.setdefault("OMP_NUM_THREADS", "1")
    # A test process may carry a one-process group's variables; the doctor must not
    # think it is a torchrun worker.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        environ.pop(name, None)
    return environ


def run_doctor(name: str, *args: str, nproc: int = 2, timeout: float = 240) -> tuple[int, dict[str, Any], str]:
    """(exit status, the JSON report, the script's output) for `ddpgraph doctor` on `name`."""
    cmd = [sys.executable, "-m", "ddpgraph", "doctor", "--json", "--nproc", str(nproc),
           "--timeout", str(timeout), str(script(name)), *args]
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout + 60, check=False)
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError as err:
        raise AssertionError(f"no JSON report (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}") from err
    return done.returncode, report, done.stderr


def run_plain(name: str, *args: str, nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """The same script under plain torchrun, without the doctor."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script(name)), *args]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout, check=False)


def summary(report: dict[str, Any]) -> list[tuple[str, list[int], int | None]]:
    """(code, ranks, line) of each finding, for comparing with the marks."""
    return [
        (f["code"], f["ranks"], f["location"]["line"] if f["location"] else None)
        for f in report["findings"]
    ]
