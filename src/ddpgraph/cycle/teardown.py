"""Graphs are freed before the process group, also when the user forgets `close()`.

A captured graph holds the NCCL communicator its collectives were recorded on, and since
NCCL 2.26 destroying a communicator waits until every graph referencing it is destroyed.
torch.distributed registers no exit hook: a process group nobody destroyed is destroyed
when the interpreter finalises its objects, which is after `atexit` handlers run. So an
`atexit` handler that closes every live captured step frees their graphs first. Steps are
held weakly: a step the user dropped is not kept alive until exit.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Callable

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
    creation, as nested `with` blocks would). `ddpgraph.ddp.distributed.shutdown` calls it
    before destroying the process group; so does interpreter exit."""
    for key in sorted(_live, reverse=True):
        close = _live.pop(key)()
        if close is None:
            continue
        try:
            close()
        except Exception:  # one step failing to close must not keep the others' graphs
            log.exception("closing a captured step at exit failed")
