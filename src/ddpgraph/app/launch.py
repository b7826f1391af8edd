"""Starting the workers of a ddpgraph command through torchrun.

`ddpgraph demo` (and the other commands) work two ways: under `torchrun`, where each
process is one worker, and as a plain command, which starts `torchrun` itself with one
process per GPU (or two CPU processes) and waits for it. torchrun stays the launcher
and does the rendezvous; nothing here replaces it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from ..ddp.process import cuda_available, gpu_count, launched_by_torchrun
from .job import run_job

__all__ = [
    "LAUNCHER_OPTIONS",
    "default_nproc",
    "launched_by_torchrun",
    "run_under_torchrun",
    "torchrun_command",
    "worker_args",
]

# Options of a command that only the launching process reads. They are not passed on:
# the workers do not need them, and torchrun's own parser, which sees the workers'
# arguments first, takes `--nproc` for an ambiguous abbreviation of its
# `--nproc-per-node` / `--nproc_per_node` and stops with its usage screen.
LAUNCHER_OPTIONS = ("--nproc",)


def default_nproc() -> int:
    """One process per visible GPU, or two CPU processes (gloo) without CUDA."""
    return gpu_count() or 2


def torchrun_command(module_args: Sequence[str], nproc: int, module: str = "ddpgraph") -> list[str]:
    """`python -m torch.distributed.run ... -m <module> <module_args>` on this machine."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        module,
        *module_args,
    ]


def worker_args(argv: Sequence[str]) -> list[str]:
    """`argv` without the launcher's own options (`--nproc 2` and `--nproc=2`).

    Command parsers are built with `allow_abbrev=False`, so an option reaches here with
    its full name.
    """
    kept: list[str] = []
    value_follows = False
    for arg in argv:
        if value_follows:
            value_follows = False
        elif arg in LAUNCHER_OPTIONS:
            value_follows = True
        elif arg.split("=", 1)[0] not in LAUNCHER_OPTIONS:
            kept.append(arg)
    return kept


def run_under_torchrun(module_args: Sequence[str], nproc: int | None = None) -> int:
    """Run `python -m ddpgraph <module_args>` in `nproc` torchrun workers; return the exit code.

    The launcher's own options (`LAUNCHER_OPTIONS`) are left out of the workers' arguments.
    Ctrl-C stops every process of the job (`job.run_job`).
    """
    n = nproc or default_nproc()
    env = dict(os.environ)
    # Two CPU workers on a small machine fight over cores with PyTorch's default threads.
    if not cuda_available():
        env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return run_job(torchrun_command(worker_args(module_args), n), env)
