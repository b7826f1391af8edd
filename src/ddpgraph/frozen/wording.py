"""The words of a FROZEN_PYTHON_VALUE finding: the values a call passed that changed,
the branch it took, the torch.compile guard that failed, or the Python state outside the
step that it changes, with the user's line."""

from __future__ import annotations

import linecache
import math
import re
from collections.abc import Hashable, Sequence
from typing import Any

from ..findings import Code, Finding, Location
from .call_lines import CallLine, line_location
from .outside_state import Changes, OutsideState
from .python_values import Divergence, Entry, Trace, call_name

_SHOWN_VALUES = 4
_VALUE_CHARS = 40


_GUARD_LINE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def guard_location(reason: str) -> Location | None:
    """The user's line in a Dynamo guard failure's reason (its "User stack trace")."""
    found = list(_GUARD_LINE.finditer(reason))
    if not found:
        return None
    file, line = found[-1]["file"], int(found[-1]["line"])
    return Location(file, line, linecache.getline(file, line).strip())


def _show(value: Any) -> str:
    text = repr(value)
    if isinstance(value, float) and math.isfinite(value):
        text = f"{value:.6g}"
    return text if len(text) <= _VALUE_CHARS else text[: _VALUE_CHARS - 3] + "..."


def _differing_argument(entries: Sequence[Entry]) -> list[Any] | None:
    """The first argument that differs between calls of one function, call by call; None
    when no argument does (the calls differ in how many they took)."""
    arity = {len(e[1]) for e in entries}
    if len(arity) != 1:
        return None
    for position in range(arity.pop()):
        column = [e[1][position] for e in entries]
        if any(c != column[0] for c in column):
            # A keyword argument is kept as (name, value).
            return [
                c[1] if isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], str) else c
                for c in column
            ]
    return None


FIX = (
    "pass the value into the step as a tensor argument (`step(x, y, torch.tensor(value))`), "
    "or keep it in a device tensor that the step updates in place (`weight.mul_(0.99)`, "
    "`count.add_(1)`); a branch on a value that changes between calls becomes a tensor "
    "operation (`torch.where`), or moves out of the step"
)


def _branch_line(here: CallLine | None, other: CallLine | None) -> Location | None:
    """The other call's line, when it comes before this call's in the same function: a
    branch body that call ran and this one skipped (this call's line is the statement
    after it, where this call went on)."""
    if here is None or other is None or other[:2] != here[:2] or other[2] >= here[2]:
        return None
    return line_location(other)


def frozen_finding(
    divergence: Divergence, older: Sequence[Trace], *, when: str, later: str
) -> Finding:
    """FROZEN_PYTHON_VALUE for `divergence`. `older` are earlier watched calls whose
    entry at that index, where it is a call of the same function, joins the values
    shown; `when` says which calls the values are from ("in the last 3 warm-up steps"),
    `later` what the graph does with them."""
    i = divergence.index
    reference, current = divergence.entries[0], divergence.entries[-1]
    where = divergence.location
    line = f"`{where.source}`" if where is not None and where.source else "the step"
    if not divergence.is_branch:
        assert reference is not None and current is not None
        earlier = [
            t.entries[i] for t in older if i < len(t.entries) and t.entries[i][0] == current[0]
        ]
        values = _differing_argument([*earlier, reference, current]) or _differing_argument(
            [reference, current]
        )
        shown = ", ".join(_show(v) for v in (values or [])[-_SHOWN_VALUES:]) or "other arguments"
        happened = (
            f"{line} passes `{call_name(current[0])}` a Python value that changes from call to "
            f"call ({shown} {when}); {later}"
        )
    else:
        ran = [f"`{call_name(e[0])}`" if e else "nothing more" for e in (current, reference)]
        inner = _branch_line(divergence.line, divergence.other_line)
        if inner is not None and where is not None:
            # The other call ran a line above this one that this call skipped: the branch.
            happened = (
                f"`{inner.source}` runs on some calls and not on others (a Python branch): "
                f"one call ran {ran[1]} there, the next went on to {ran[0]} at line "
                f"{where.lineno} ({when}); {later}"
            )
            where = inner
        else:
            happened = (
                f"{line} takes another path from call to call (a Python branch): the step ran "
                f"{ran[0]} where the other call ran {ran[1]} ({when}); {later}"
            )
    return Finding(
        Code.FROZEN_PYTHON_VALUE, happened, FIX, subject="`capture_step`", location=where
    )


def guard_finding(reasons: Sequence[str], *, when: str, later: str) -> Finding:
    """FROZEN_PYTHON_VALUE for a torch.compile guard that failed: a Python value that
    a compiled forward reads changed."""
    first = reasons[0]
    guard = first.split("\n", 1)[0].split("#", 1)[0].split(": ", 1)[-1].strip()
    return Finding(
        Code.FROZEN_PYTHON_VALUE,
        f"torch.compile's guard `{guard}` failed {when}: a Python value the compiled code reads "
        f"changed; {later}",
        FIX,
        subject="`capture_step`",
        location=guard_location(first),
    )


# ------------------------------------------------------------------ outside state
def changed_on_every_call(probe: Changes, reference: Changes) -> str | None:
    """The path, nearest its root, that both calls changed."""
    both = [p for p in probe if p in reference]
    return min(both, key=_depth) if both else None


def _depth(path: str) -> int:
    return path.count(".") + path.count("[")


def _show_kept(kept: Hashable) -> str:
    if kept is None:
        return "absent"
    assert isinstance(kept, tuple)
    kind = kept[0]
    if kind in ("list", "tuple", "deque", "dict", "set"):
        return f"{kept[1]} items"
    if kind == "tensor":
        return f"a tensor of shape {list(kept[1])}"
    if kind == "iterator":
        return "an iterator advanced"
    if kind == "object":
        return f"a `{kept[1]}`"
    return _show(kept[1])


def state_finding(path: str, older: Changes, probe: Changes, state: OutsideState) -> Finding:
    """FROZEN_PYTHON_VALUE for `path`, which the calls of `older` and `probe` changed."""
    (first, _), (last, now) = older[path], probe[path]
    kind = now[0] if isinstance(now, tuple) else None
    values = [_show_kept(v) for v in (first, last, now)]
    if len(set(values)) < len(values):  # floats that differ past 6 digits (a clock)
        values = [repr(v[1]) if isinstance(v, tuple) else "absent" for v in (first, last, now)]
    shown = "it gave another batch on each call" if kind == "iterator" else ", then ".join(values)
    where = state.write_site(path)
    return Finding(
        Code.FROZEN_PYTHON_VALUE,
        f"the step changes `{path}`, Python state outside it, on every call ({shown} over the "
        "last 2 warm-up steps); a replay runs no Python, so after capture it would stop "
        "changing while training goes on",
        "return what the step produces and do the Python work in the loop "
        "(`history.append(step(x, y))`, a step counter incremented after the call, the next "
        "batch taken before it and passed in), or keep it in a device tensor that the step "
        "updates in place (`total.add_(loss.detach())`)",
        subject="`capture_step`",
        location=where,
    )


def replaced_finding(path: str, read: CallLine | None, state: OutsideState) -> Finding:
    """FROZEN_PYTHON_VALUE for a tensor outside the step that the step reads and then
    replaces with another (`avg = avg * 0.9 + loss`, `self.h = h.detach()`), on every
    watched call."""
    return Finding(
        Code.FROZEN_PYTHON_VALUE,
        f"the step replaces `{path}`, a tensor outside it that it reads, with another "
        "tensor on every call (a running average, a recurrent state); a replay reads the "
        "tensor the graph was recorded with, not the one the step bound since, so after "
        "capture every replay would start from the same old value while training goes on",
        f"update `{path}` in place, which a replay repeats (`{path}.copy_(new_value)`, or "
        "`.mul_(0.9).add_(x, alpha=0.1)` for a running average), or return the new value "
        "and keep it in the loop",
        subject="`capture_step`",
        # The read is on the line that rebinds it, in the usual `avg = avg * 0.9 + x`.
        location=line_location(read) or state.write_site(path),
    )
