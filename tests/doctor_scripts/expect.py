"""For the tests: run `ddpgraph doctor --json` on a script here, and read what its
comments expect.

* `# doctor: CODE [rank N]` marks the line a finding must name on a machine with GPUs
  (on every rank, or on rank N only); a script without marks must come back clean.
* `# doctor-cpu: CODE` marks what a machine without a GPU must report instead. A script
  for the GPU without such a mark must report NO_CUDA there (at any line); a `cpu_`
  script expects its `# doctor:` marks on either machine.
* `# doctor-ranks: N`: the expectations need at least N ranks (skipped with fewer).
* `# doctor-timeout: S`: run the doctor with `--timeout S`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
REPO = HERE.parent.parent
_MARK = re.compile(r"#\s*doctor:\s*(?P<code>[A-Z_]+)(?:\s+rank\s+(?P<rank>\d+))?")
_CPU_MARK = re.compile(r"#\s*doctor-cpu:\s*(?P<code>[A-Z_]+)")
_RANKS = re.compile(r"#\s*doctor-ranks:\s*(?P<n>\d+)")
_TIMEOUT = re.compile(r"#\s*doctor-timeout:\s*(?P<s>\d+)")
NOT_SCRIPTS = ("common.py", "expect.py", "score.py")
DEFAULT_TIMEOUT = 240.0


@dataclass(frozen=True)
class Expected:
    """A finding a script must get: its code, the rank (None: every rank) and the line
    (None: any line) it must name."""

    code: str
    rank: int | None
    line: int | None


def all_scripts() -> list[str]:
    return sorted(p.name for p in HERE.glob("*.py") if p.name not in NOT_SCRIPTS)


def expectations(name: str, *, gpu: bool) -> list[Expected]:
    """What `ddpgraph doctor` must report for script `name` on a machine with GPUs, or on
    one without (`gpu=False`)."""
    text = script(name).read_text().splitlines()
    if not gpu:
        cpu = [
            Expected(m["code"], None, n)
            for n, line in enumerate(text, 1)
            if (m := _CPU_MARK.search(line))
        ]
        if cpu:
            return cpu
        if not name.startswith("cpu_"):
            return [Expected("NO_CUDA", None, None)]
    return [
        Expected(code, rank, line)
        for code, lines in marked(name).items()
        for rank, line in lines.items()
    ]


def _directive(name: str, pattern: re.Pattern[str]) -> str | None:
    match = pattern.search(script(name).read_text())
    return next(iter(match.groupdict().values())) if match else None


def ranks_needed(name: str) -> int:
    return int(_directive(name, _RANKS) or 1)


def doctor_timeout(name: str) -> float:
    return float(_directive(name, _TIMEOUT) or DEFAULT_TIMEOUT)


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


def run_doctor(
    name: str, *args: str, nproc: int = 2, timeout: float = 240
) -> tuple[int, dict[str, Any], str]:
    """(exit status, the JSON report, the script's output) for `ddpgraph doctor` on `name`."""
    cmd = [
        sys.executable,
        "-m",
        "ddpgraph",
        "doctor",
        "--json",
        "--nproc",
        str(nproc),
        "--timeout",
        str(timeout),
        str(script(name)),
        *args,
    ]
    done = subprocess.run(
        cmd, env=env(), capture_output=True, text=True, timeout=timeout + 60, check=False
    )
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError as err:
        raise AssertionError(
            f"no JSON report (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}"
        ) from err
    return done.returncode, report, done.stderr


def run_plain(
    name: str, *args: str, nproc: int = 2, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """The same script under plain torchrun, without the doctor."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script(name)),
        *args,
    ]
    return subprocess.run(
        cmd, env=env(), capture_output=True, text=True, timeout=timeout, check=False
    )


def summary(report: dict[str, Any]) -> list[tuple[str, list[int], int | None]]:
    """(code, ranks, line) of each finding, for comparing with the marks."""
    return [
        (f["code"], f["ranks"], f["location"]["line"] if f["location"] else None)
        for f in report["findings"]
    ]
