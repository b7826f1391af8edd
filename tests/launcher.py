"""Starting scenario scripts under torchrun from tests, and reading their results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the torchrun workers of doc_blocks.py import this module too
    import pytest

SCENARIOS = Path(__file__).parent / "scenarios"
REPO = Path(__file__).parent.parent


TWO_RANKS_REASON = "compares two ranks; this run has one (DDPGRAPH_GPU_WORLD=1)"


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_world() -> int:
    """Processes (one per GPU) the GPU tests launch: DDPGRAPH_GPU_WORLD, or else two where
    two GPUs are present and one on a one-GPU machine (then the checks that compare ranks
    skip). Without GPUs it is 2, and the GPU tests skip for want of them."""
    if "DDPGRAPH_GPU_WORLD" in os.environ:
        return int(os.environ["DDPGRAPH_GPU_WORLD"])
    found = gpu_count()
    return min(2, found) if found else 2


def gpu_skip_reason(*, two_ranks: bool, world: int, found: int) -> str | None:
    """Why a GPU test does not run here, or None: too few GPUs for the world size, or a
    test marked `two_ranks` (it compares ranks) in a one-rank run."""
    if found < world:
        return f"needs {world} CUDA GPUs, found {found}"
    if two_ranks and world < 2:
        return TWO_RANKS_REASON
    return None


def scenarios_for_world(
    names: list[str], two_ranks: set[str], world: int | None = None
) -> list[str]:
    """The scenarios a GPU test module launches: at world size 1, not those that only its
    `two_ranks` tests read (they skip, and the run is shorter without them)."""
    unknown = two_ranks - set(names)
    if unknown:
        raise ValueError(f"not among the scenarios: {sorted(unknown)}")
    size = gpu_world() if world is None else world
    return [n for n in names if size >= 2 or n not in two_ranks]


def torchrun_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "src"), str(SCENARIOS), env.get("PYTHONPATH", "")]
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def torchrun_command(launch: list[str], script: str, out: Path, names: list[str]) -> list[str]:
    """`python -m torch.distributed.run <launch> <script> --out <out> <names>`."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launch,
        str(SCENARIOS / script),
        "--out",
        str(out),
        *names,
    ]


def run_scenarios(
    script: str,
    names: list[str],
    out: Path,
    *,
    nproc: int = 2,
    timeout: float = 600,
    extra_args: list[str] | None = None,
    group_timeout_s: float | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Run `names` from `script` in `nproc` workers; return {name: [rank0, rank1, ...]}.
    `group_timeout_s`: the workers' process-group timeout (harness.py reads it), short where
    a rank left waiting must fail its scenario rather than pass late."""
    cmd = torchrun_command(
        ["--standalone", f"--nproc_per_node={nproc}", *(extra_args or [])], script, out, names
    )
    env = torchrun_env()
    if group_timeout_s is not None:
        env["DDPGRAPH_TEST_PG_TIMEOUT"] = str(group_timeout_s)
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    (out / "torchrun.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    return collect(out, names, nproc, proc)


# The script that runs the scenarios of several scripts in one launch.
TOGETHER = "together.py"


def together_name(script: str, name: str) -> str:
    """`name` of `script` as together.py reads it: "recording:x" of a.py is "recording:a.x"."""
    kind, sep, base = name.rpartition(":")
    return f"{kind}{sep}{Path(script).stem}.{base}"


@dataclass
class _Launch:
    """The scenarios that will share one torchrun launch of `nproc` processes."""

    nproc: int
    group_timeout_s: float | None
    members: list[Batch] = field(default_factory=list)
    found: dict[str, list[dict[str, Any]]] | None = None


_launches: dict[tuple[int, float | None], _Launch] = {}
_batches: list[Batch] = []


@dataclass(eq=False)
class Batch:
    """One test module's scenarios in a launch shared with other modules (`batched`)."""

    launch: _Launch
    script: str
    names: list[str]
    timeout: float
    # False once the session's selection (`-k`, a node id) left no test of its module.
    selected: bool = True

    def results(self, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
        """{name: [rank0, rank1, ...]} for this module's names; the first module to ask
        runs the whole launch: the scenarios of every selected module, in the order the
        modules were imported."""
        launch = self.launch
        if launch.found is None:
            members = [b for b in launch.members if b.selected or b is self]
            timeout = (
                ""
                if launch.group_timeout_s is None
                else f"_group_timeout{launch.group_timeout_s:g}s"
            )
            out = tmp_path_factory.mktemp(f"together_{launch.nproc}proc{timeout}_")
            names = [together_name(b.script, n) for b in members for n in b.names]
            launch.found = {}  # a launch that raised is not run again by the next module
            launch.found = run_scenarios(
                TOGETHER,
                names,
                out,
                nproc=launch.nproc,
                timeout=sum(b.timeout for b in members),
                group_timeout_s=launch.group_timeout_s,
            )
        missing = [
            {
                "error": (
                    "the shared launch did not finish, or left this module out "
                    "(see the first test that used it)"
                )
            }
        ]
        return {
            n: launch.found.get(together_name(self.script, n), missing * launch.nproc)
            for n in self.names
        }


def batched(
    script: str,
    names: list[str],
    *,
    nproc: int,
    timeout: float,
    group_timeout_s: float | None = None,
) -> Batch:
    """`run_scenarios(script, names, ...)`, run later in one launch with the scenarios of
    every other module that asks for the same `nproc` and `group_timeout_s`.

    Call it when the module is imported: pytest imports every test module before it runs
    any test, so the launch, made when a test first needs results, holds all of them. Its
    time limit is the sum of the members' (`timeout` each, as for `run_scenarios`)."""
    key = (nproc, group_timeout_s)
    launch = _launches.get(key)
    if launch is None or launch.found is not None:
        launch = _launches[key] = _Launch(nproc, group_timeout_s)
    batch = Batch(launch, script, list(names), timeout)
    launch.members.append(batch)
    _batches.append(batch)
    return batch


def select_batches(modules: list[Any]) -> None:
    """Leave out of the shared launches the batches of modules none of whose tests the
    session runs (tests/conftest.py calls it with the selected tests' modules): a module
    holds its batches at its top level, alone or as the values of a dict."""
    held: set[int] = set()
    for module in modules:
        for value in vars(module).values():
            for item in value.values() if isinstance(value, dict) else [value]:
                if isinstance(item, Batch):
                    held.add(id(item))
    for batch in _batches:
        batch.selected = id(batch) in held


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
                tail = proc.stderr[-3000:] if proc is not None else ""
                ranks.append({"error": f"no result from rank {r}; torchrun said:\n{tail}"})
        results[name] = ranks
    return results


def ok(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-rank results, after failing the test with the first rank's error if any."""
    for r in results:
        if "error" in r:
            raise AssertionError(r["error"])
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_scenarios_multinode(
    script: str,
    names: list[str],
    out: Path,
    *,
    nnodes: int = 2,
    nproc_per_node: int = 1,
    timeout: float = 600,
) -> dict[str, list[dict[str, Any]]]:
    """Run `names` as a job of `nnodes` torchrun agents on this machine, one agent per
    "node", meeting through torchrun's c10d rendezvous as separate hosts would.

    Returns {name: [rank0, rank1, ...]} over all nnodes * nproc_per_node ranks.
    """
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv_id = f"ddpgraph-test-{uuid.uuid4().hex[:12]}"
    procs = []
    for node in range(nnodes):
        launch = [
            f"--nnodes={nnodes}",
            f"--node-rank={node}",
            f"--nproc-per-node={nproc_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={rdzv_id}",
            "--local-addr=127.0.0.1",
        ]
        cmd = torchrun_command(launch, script, out, names)
        procs.append(
            subprocess.Popen(
                cmd, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    deadline = time.monotonic() + timeout
    logs = []
    for node, proc in enumerate(procs):
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            stderr += f"\n(node {node} killed after {timeout} s)"
        logs.append((stdout, stderr))
    for node, (stdout, stderr) in enumerate(logs):
        (out / f"torchrun.node{node}.log").write_text(stdout + "\n--- stderr ---\n" + stderr)
    merged = subprocess.CompletedProcess(
        [],
        max(p.returncode for p in procs),
        "".join(o for o, _ in logs),
        "".join(e for _, e in logs),
    )
    return collect(out, names, nnodes * nproc_per_node, merged)
