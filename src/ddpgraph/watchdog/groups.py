"""What the replay watchdog reads from a process group, and what it does to one.

torch.distributed's private helpers move between releases, so each is looked up by
presence, with a documented fallback, never by version number.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("ddpgraph")

# The timeout used when no process group says otherwise: NCCL's own default in c10d.
DEFAULT_TIMEOUT_S = 600.0


def _c10d() -> Any:
    import torch.distributed.distributed_c10d as c10d

    return c10d


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def resolve(group: Any) -> Any:
    """`group` itself, or the default group when it is None and one exists, else None."""
    if group is not None:
        return group
    return _c10d()._get_default_group() if initialized() else None


def _backends(pg: Any) -> list[Any]:
    found = []
    for device in getattr(pg, "_device_types", None) or [torch.device("cuda"), torch.device("cpu")]:
        try:
            found.append(pg._get_backend(torch.device(device)))
        except (RuntimeError, AttributeError, TypeError):
            continue
    return found


def timeout_s(group: Any) -> float:
    """The timeout the process group was created with (`init_process_group(timeout=...)`).

    Read from the backend's options (`_timeout`), else from the store, which
    `init_process_group` gives the same timeout, else c10d's default for the backend;
    `DEFAULT_TIMEOUT_S` without a process group.
    """
    pg = resolve(group)
    if pg is None:
        return DEFAULT_TIMEOUT_S
    for backend in _backends(pg):
        value = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(value, datetime.timedelta) and value.total_seconds() > 0:
            return value.total_seconds()
    store = job_store()
    value = getattr(store, "timeout", None)
    if isinstance(value, datetime.timedelta) and value.total_seconds() > 0:
        return value.total_seconds()
    default = getattr(_c10d(), "_get_default_timeout", None)
    if default is not None:
        try:
            return float(default(dist.get_backend(pg)).total_seconds())
        except (RuntimeError, ValueError):
            pass
    return DEFAULT_TIMEOUT_S


def job_store() -> Any:
    """The store every rank of the job reaches (torchrun's TCPStore), or None."""
    getter = getattr(_c10d(), "_get_default_store", None)
    if getter is None or not initialized():
        return None
    try:
        return getter()
    except (RuntimeError, ValueError):
        return None


def global_rank() -> int:
    return dist.get_rank() if initialized() else 0


def ranks_of(group: Any) -> list[int]:
    """The global ranks in `group` (the default group when None); [0] without one."""
    pg = resolve(group)
    if pg is None:
        return [0]
    return list(dist.get_process_group_ranks(pg))


def abort(group: Any) -> str:
    """Abort the group's communicators, so that every collective waiting in them, also
    one replayed from a graph, returns. Says which API did it ("" when none exists)."""
    pg = resolve(group)
    if pg is None:
        return ""
    if hasattr(pg, "abort"):
        pg.abort()
        return "ProcessGroup.abort"
    done = ""
    for backend in _backends(pg):
        if hasattr(backend, "abort"):
            backend.abort()
            done = f"{type(backend).__name__}.abort"
    if done:
        return done
    # The last resort also removes the group from torch.distributed's tables; it is
    # only reached on builds that have neither method above.
    fallback = getattr(_c10d(), "_abort_process_group", None)
    if fallback is not None:
        fallback(pg)
        return "_abort_process_group"
    return ""
