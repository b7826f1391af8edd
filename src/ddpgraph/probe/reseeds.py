"""A step that re-seeds PyTorch's random generator (`torch.manual_seed(k)` inside it).

Eager calls then restart the generator's numbers on every call (the same dropout masks,
the same noise), and a replay cannot: a graph draws from the generator's seed and an
offset it advances by each replay, set once, while recording. So the replays would
differ from eager training without a word. The probe step watches PyTorch's seeding
functions in its own thread and notes the user's line of the first call.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import ddpgraph_file
from ..findings import Code, Finding, Location
from .syncs import user_location

# The seeding functions a training script calls, by the module that holds each name.
_SEEDERS: tuple[tuple[Any, str], ...] = (
    (torch, "manual_seed"),
    (torch, "seed"),
    (torch.random, "manual_seed"),
    (torch.random, "seed"),
    (torch.cuda, "manual_seed"),
    (torch.cuda, "manual_seed_all"),
)


@contextmanager
def reseeds() -> Iterator[list[Location | None]]:
    """While the block runs, the lines (one at most) where this thread re-seeded."""
    found: list[Location | None] = []
    thread = threading.get_ident()
    given = [
        (module, name, getattr(module, name)) for module, name in _SEEDERS if hasattr(module, name)
    ]

    def watched(original: Callable[..., Any]) -> Callable[..., Any]:
        def seed(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if not found and threading.get_ident() == thread and not ddpgraph_file(caller):
                found.append(user_location())
            return original(*args, **kwargs)

        return seed

    wrappers = [watched(original) for _, _, original in given]
    for (module, name, _), wrapper in zip(given, wrappers, strict=True):
        setattr(module, name, wrapper)
    try:
        yield found
    finally:
        for (module, name, original), wrapper in zip(given, wrappers, strict=True):
            # Unless PyTorch wrapped it meanwhile (Dynamo wraps `torch.manual_seed` when it
            # is first imported): theirs stays, and calls through ours to the original.
            if getattr(module, name) is wrapper:
                setattr(module, name, original)


def reseed_finding(where: Location | None) -> Finding:
    return Finding(
        Code.UNSUPPORTED_SETUP,
        "the step function re-seeds PyTorch's random generator: eager calls restart its "
        "numbers on every call, and replays cannot (a graph advances the generator from "
        "the state it recorded), so they would differ from eager training",
        "seed once, before the training loop; random numbers that must repeat can be made "
        "outside the step and passed in as tensors",
        subject="captured function",
        location=where,
    )
