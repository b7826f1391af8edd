"""Where the step's own code writes an optimizer's hyper-parameters: the user's line of
each key's first write into a param group during the probe step.

A plain assignment (`group["lr"] = warmup_lr(i)`, a scheduler's `param_group["lr"] = lr`)
leaves no trace in any tensor, so the param groups are watched dicts for the probe step
only: each notes the line of the first write of each key that comes from outside
ddpgraph (its own graph-safe mode writes tensors into the groups and back), and the
original dicts, with whatever was written, are back in place afterwards.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch.optim import Optimizer

from ..errors import ddpgraph_file
from ..findings import Location
from ..probe.syncs import user_location

# (optimizer index, group index, key): the user's line of its first write.
Written = dict[tuple[int, int, str], Location | None]


class _WatchedGroup(dict[str, Any]):
    def __init__(self, group: dict[str, Any], where: Written, at: tuple[int, int]) -> None:
        super().__init__(group)
        self._where, self._at = where, at

    def __setitem__(self, key: str, value: Any) -> None:
        spot = (*self._at, key)
        if spot not in self._where and not ddpgraph_file(sys._getframe(1).f_code.co_filename):
            self._where[spot] = user_location()
        super().__setitem__(key, value)


@contextmanager
def group_writes(optimizers: Sequence[Optimizer]) -> Iterator[Written]:
    """Watch the param groups (plain dicts only) of `optimizers` while the block runs."""
    where: Written = {}
    swapped: list[tuple[list[Any], int, dict[str, Any], _WatchedGroup]] = []
    for o, opt in enumerate(optimizers):
        groups = opt.param_groups
        for g, group in enumerate(groups):
            if type(group) is dict:
                groups[g] = watched = _WatchedGroup(group, where, (o, g))
                swapped.append((groups, g, group, watched))
    try:
        yield where
    finally:
        for groups, g, original, watched in swapped:
            original.clear()
            original.update(watched)
            if g < len(groups) and groups[g] is watched:  # unless the step replaced it
                groups[g] = original
