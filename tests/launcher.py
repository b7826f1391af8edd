"""Starting scenario scripts under torchrun from tests, and reading their results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SCENARIOS = Path(__file__).parent / "scenarios"
REPO = Path(__file__).parent.parent


def torchrun_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "src"), str(SCENARIOS), env.get("PYTHONPATH", "")]
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_scenarios(
    script: str,
    names: list[str],
    out: Path,
    *,
    nproc: int = 2,
    timeout: float = 600,
    extra_args: list[str] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Run `names` from `script` in `nproc` workers; return {name: [rank0, rank1, ...]}."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *(extra_args or []),
        str(SCENARIOS / script),
        "--out",
        str(out),
        *names,
    ]
    proc = subprocess.run(
        cmd, env=torchrun_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    (out / "torchrun.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    return collect(out, names, nproc, proc)


def collect(
    out: Path, names: list[str], nproc: int, proc: subprocess.CompletedProcess[str] | None = None
) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        ranks = []
        for r in range(nproc):
            path = out / f"{name}.rank{r}.json"
            if path.exists():
                ranks.append(json.loads(path.read_text()))
            else:
                tail = (proc.stderr[-3000:] if proc is not None else "")
                ranks.append({"error": f"no result from rank {r}; torchrun said:\n{tail}"})
        results[name] = ranks
    return results


def ok(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-rank results, after failing the test with the first rank's error if any."""
    for r in results:
        if "error" in r:
            raise AssertionError(r["error"])
    return results
