"""Checks of command-line arguments shared by the `ddpgraph` commands.

Every command checks all of its arguments in the launching process, before any worker
starts, and reports the first bad one in the one template (`errors.usage_error`: code,
what was expected and given, the fix) with exit status 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..ddp.process import cuda_available, gpu_count
from ..errors import DdpGraphUsageError, usage_error

USAGE_EXIT = 2


def at_least(option: str, value: int | None, least: int, fix: str | None = None) -> None:
    """Refuse `value` below `least`; None stands for the command's default."""
    if value is not None and value < least:
        raise usage_error(
            f"`{option}`",
            f"expected at least {least}, got {value}",
            fix or f"use {option} {least} or more, or leave it out for the default",
        )


def process_count(nproc: int | None, cpu: bool) -> None:
    """`--nproc`: at least 1, and with CUDA at most one process per GPU (NCCL refuses
    two processes on one GPU)."""
    at_least("--nproc", nproc, 1)
    gpus = gpu_count() if not cpu else 0
    if nproc is not None and gpus and nproc > gpus:
        raise usage_error(
            "`--nproc`",
            f"expected at most {gpus}, one process per GPU, got {nproc}",
            f"use --nproc {gpus} or fewer, or add --cpu for CPU processes",
        )


def crowded_cores(nproc: int | None, cpu: bool) -> str | None:
    """What to say before starting more CPU processes than there are cores: they share
    the cores, each step waits for the slowest, and the run takes minutes."""
    on_cpu = cpu or not cuda_available()
    cores = os.cpu_count() or 1
    if nproc is None or not on_cpu or nproc <= cores:
        return None
    return (
        f"--nproc {nproc} starts {nproc} CPU processes on {cores} cores: they share the cores, "
        "every step waits for the slowest of them, and starting them alone takes minutes "
        f"(the default on CPU is 2; --nproc {cores} or fewer keeps one core each)"
    )


def say_before_start(lines: list[str]) -> None:
    """Warnings the launching process prints before any worker starts."""
    for line in lines:
        print(f"ddpgraph: warning: {line}", file=sys.stderr, flush=True)


def output_file(
    option: str, path: str | None, example: str, suffixes: tuple[str, ...] = ()
) -> None:
    """Refuse a file that cannot be written at the end of the run: a folder that does not
    exist or is not writable, a path that is a folder, or (given `suffixes`) a format the
    writer does not know."""
    if path is None:
        return
    target = Path(path)
    folder = target.parent
    if suffixes and target.suffix.lower().lstrip(".") not in suffixes:
        raise usage_error(
            f"`{option}`",
            f"expected a file ending in one of {', '.join('.' + s for s in suffixes)}, "
            f"got {path!r}",
            f"name the file for its format, e.g. `{option} {example}`",
        )
    if target.is_dir():
        raise usage_error(
            f"`{option}`",
            f"expected a file name, got the folder {path!r}",
            f"name a file in it, e.g. `{option} {target / example}`",
        )
    if not folder.is_dir():
        raise usage_error(
            f"`{option}`",
            f"expected a file in an existing folder, got {path!r}, "
            f"and {str(folder)!r} does not exist",
            f"create the folder first (`mkdir -p {folder}`) or write the file elsewhere",
        )
    if not os.access(folder, os.W_OK):
        raise usage_error(
            f"`{option}`",
            f"expected a folder this user can write to, got {str(folder)!r}",
            "write the file to a folder of your own",
        )


def report(err: DdpGraphUsageError) -> int:
    """Print the error the way every command does, and return the exit status for it."""
    print(err.finding.format(), file=sys.stderr)
    return USAGE_EXIT
