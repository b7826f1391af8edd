"""Starting scenario scripts under torchrun from tests, and reading their results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

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
        # tests/ too: the scenarios share its stand-ins (`perturbed`) with the unit tests.
        [str(REPO / "src"), str(SCENARIOS), str(REPO / "tests"), env.get("PYTHONPATH", "")]
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
    proc = start_scenarios(
        script, names, out, nproc=nproc, extra_args=extra_args, group_timeout_s=group_timeout_s
    )
    return finish_scenarios(proc, out, names, nproc, timeout)


def start_scenarios(
    script: str,
    names: list[str],
    out: Path,
    *,
    nproc: int,
    extra_args: list[str] | None = None,
    group_timeout_s: float | None = None,
) -> subprocess.Popen[str]:
    """The torchrun launch of `run_scenarios`, started and not waited for."""
    cmd = torchrun_command(
        ["--standalone", f"--nproc_per_node={nproc}", *(extra_args or [])], script, out, names
    )
    env = torchrun_env()
    if group_timeout_s is not None:
        env["DDPGRAPH_TEST_PG_TIMEOUT"] = str(group_timeout_s)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_scenarios(
    proc: subprocess.Popen[str], out: Path, names: list[str], nproc: int, timeout: float
) -> dict[str, list[dict[str, Any]]]:
    """Wait for a launch of `start_scenarios` (killed past `timeout`, which raises), keep
    its log beside its results and read them."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    (out / "torchrun.log").write_text(stdout + "\n--- stderr ---\n" + stderr)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return collect(out, names, nproc, done)


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


# How long the other agents may take to end once one has failed. An agent does not hear of
# another host's failure until its own workers fail, and a worker can wait in its process
# group's teardown for a rank whose process is gone (seen: a rank aborting at exit, after
# writing its results, left the other agent waiting for the whole time limit).
_NODE_FAILED_GRACE_S = 30.0


def wait_for_nodes(
    procs: list[subprocess.Popen[str]], timeout: float, grace: float = _NODE_FAILED_GRACE_S
) -> list[tuple[str, str]]:
    """Each agent's (stdout, stderr), once all have ended: within `timeout`, and within
    `grace` seconds of the first to fail; an agent still running then is killed, which its
    log says."""

    outputs: dict[int, tuple[str, str]] = {}

    def read(node: int, proc: subprocess.Popen[str]) -> None:
        outputs[node] = proc.communicate()  # to the end: pipes never fill up

    readers = [threading.Thread(target=read, args=(n, p), daemon=True) for n, p in enumerate(procs)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.2)
    killed = [n for n, p in enumerate(procs) if p.poll() is None]
    for node in killed:
        procs[node].kill()
    for reader in readers:
        reader.join()
    return [
        (out, err + (f"\n(node {n} killed: still running)" if n in killed else ""))
        for n, (out, err) in sorted(outputs.items())
    ]


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
    logs = wait_for_nodes(procs, timeout)
    for node, (stdout, stderr) in enumerate(logs):
        (out / f"torchrun.node{node}.log").write_text(stdout + "\n--- stderr ---\n" + stderr)
    merged = subprocess.CompletedProcess(
        [],
        max(p.returncode for p in procs),
        "".join(o for o, _ in logs),
        "".join(e for _, e in logs),
    )
    return collect(out, names, nnodes * nproc_per_node, merged)
