"""The plain values the step reads from outside it (a number in a closure, a global flag),
kept when the graph is recorded and compared before each replay.

A replay runs no Python: a step that reads `epoch` from the function around it, or a
global `AUX_WEIGHT`, repeats the value it read while recorded, and a loop that changes it
after capture trains on with the old one, without a word. The warm-up watch sees values
that change from call to call; these change later (a new epoch, a flag set at step 1000).
Reading a closure cell or a global costs well under a microsecond, so every replay is
checked; one that finds a value changed runs eagerly (`captured_step`), and a check call
(`verify_every`) that follows captures again with the new value.
"""

from __future__ import annotations

import dis
from collections.abc import Callable
from typing import Any

from ..findings import Code, Finding, Location
from .call_lines import line_location
from .outside_state import OutsideState

# Loads of a name (not of an attribute of that name: `opt.epoch`).
_NAME_LOADS = frozenset(
    {
        "LOAD_GLOBAL",
        "LOAD_DEREF",
        "LOAD_NAME",
        "LOAD_CLASSDEREF",
        "LOAD_FROM_DICT_OR_DEREF",
        "LOAD_FROM_DICT_OR_GLOBALS",
    }
)


class PlainRoots:
    """The plain roots of one step at capture, with their values then."""

    def __init__(self, state: OutsideState) -> None:
        self._kept = state.plain_values()

    def changed(self, subject: str) -> Finding | None:
        """FROZEN_PYTHON_VALUE for the first value that differs now, or None. Never
        raises: a rank whose check raised would leave the others waiting."""
        for name, read, was, owner in self._kept:
            try:
                now = read()
            except Exception:  # a global deleted since: not ours to judge
                continue
            if now is was or (type(now) is type(was) and now == was):
                continue
            return Finding(
                Code.FROZEN_PYTHON_VALUE,
                f"the step reads `{name}`, which was {was!r} when the graph was recorded and "
                f"is {now!r} now; a replay runs no Python, so it would go on with {was!r}",
                "pass it to the step as a device tensor it reads "
                f"(`step(x, y, torch.tensor({name}, device=...))`), move the Python that "
                "uses it out of the step, or build a new step after changing it; until "
                "then, such calls run eagerly",
                subject=subject,
                location=_read_site(owner, name),
            )
        return None


def _read_site(fn: Callable[..., Any] | None, name: str) -> Location | None:
    """The first line of `fn` (or code nested in it) that loads `name`."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    pending = [code]
    while pending:
        current = pending.pop(0)
        for instruction in dis.get_instructions(current):
            if instruction.argval == name and instruction.opname in _NAME_LOADS:
                positions = getattr(instruction, "positions", None)
                line = getattr(positions, "lineno", None) or instruction.starts_line
                if isinstance(line, int):
                    return line_location((current.co_filename, current.co_firstlineno, line))
        pending += [c for c in current.co_consts if hasattr(c, "co_code")]
    return None
