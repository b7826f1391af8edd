"""The process's place in the job: process-group setup and shutdown (launcher detection
and the rank, which the launching process reads without torch, live in `process`).

torchrun is the launcher (single node and multi-node alike); this module only reads
what torchrun sets and initialises the default process group from it.

Graphs are freed before the process group, also when the user forgets `close()`.

A captured graph holds the NCCL communicator its collectives were recorded on, and since
NCCL 2.26 destroying a communicator waits until every graph referencing it is destroyed.
torch.distributed registers no exit hook: a process group nobody destroyed is destroyed
when the interpreter finalises its objects, which is after `atexit` handlers run. So an
`atexit` handler that closes every live captured step frees their graphs first. Steps are
held weakly: a step the user dropped is not kept alive until exit.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .process import launched_by_torchrun


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(
    *, backend: str | None = None, timeout_s: float = 600.0, force_cpu: bool = False
) -> DistInfo:
    """Initialise the default process group from torchrun's variables, once.

    NCCL with one GPU per process when CUDA is available (the device is LOCAL_RANK),
    gloo on CPU otherwise. Outside torchrun this makes a one-process group, so the same
    script runs as `python train.py` and as `torchrun --nproc_per_node=N train.py`.
    """
    use_cuda = torch.cuda.is_available() and not force_cpu
    if not launched_by_torchrun():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    chosen = backend or ("nccl" if use_cuda else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(chosen, timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, chosen)


def shutdown() -> None:
    """Destroy the default process group if this process created one, after closing
    the captured steps still alive: a live graph holds the NCCL communicator."""
    close_live_steps()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------- graphs before the group
log = logging.getLogger("ddpgraph")

_live: dict[int, weakref.WeakMethod[Callable[[], None]]] = {}
_next = 0
_registered = False


def close_at_exit(close: Callable[[], None]) -> None:
    """Call the bound method `close` at interpreter exit if its object is still alive."""
    global _next, _registered
    for key in [k for k, ref in _live.items() if ref() is None]:
        del _live[key]  # steps already collected
    _live[_next] = weakref.WeakMethod(close)  # type: ignore[arg-type]
    _next += 1
    if not _registered:
        atexit.register(close_live_steps)
        _registered = True


def close_live_steps() -> None:
    """Close every registered step that is still alive, newest first (the reverse of
    creation, as nested `with` blocks would). `shutdown` calls it
    before destroying the process group; so does interpreter exit."""
    for key in sorted(_live, reverse=True):
        close = _live.pop(key)()
        if close is None:
            continue
        try:
            close()
        except Exception:  # one step failing to close must not keep the others' graphs
            log.exception("closing a captured step at exit failed")
