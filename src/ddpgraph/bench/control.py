"""Every rank learns how every phase went on every rank, before the next phase starts.

A strategy that raises on one rank while the others go on into the next collective
would hang the job. Each phase of a strategy therefore ends with an exchange of
outcomes, and all ranks stop the strategy together when any of them failed. The
exchange runs over a CPU (gloo) group, so a CUDA or NCCL error in the phase does not
also break the exchange that reports it.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ..findings import format_ranks

T = TypeVar("T")

# How much of an exception message a result keeps: its head says what went wrong.
_MAX_LINES = 4
_MAX_CHARS = 600


class PhaseFailed(Exception):
    """A phase raised on at least one rank; `errors` maps rank to its message."""

    def __init__(self, phase: str, errors: dict[int, str]) -> None:
        self.phase = phase
        self.errors = errors
        super().__init__(self.describe())

    def describe(self) -> str:
        by_message: dict[str, list[int]] = {}
        for rank, message in sorted(self.errors.items()):
            by_message.setdefault(message, []).append(rank)
        parts = [
            f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}: {message}"
            for message, ranks in by_message.items()
        ]
        return f"failed during {self.phase} ({'; '.join(parts)})"


class Control:
    """Exchanges small Python objects between all ranks over `group` (None: default)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group

    @classmethod
    def for_backend(cls, backend: str) -> Control:
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        return cls(None if backend == "gloo" else dist.new_group(backend="gloo"))

    def gather(self, value: Any) -> list[Any]:
        if not (dist.is_available() and dist.is_initialized()):
            return [value]
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, value, group=self.group)
        return out

    def phase(self, name: str, fn: Callable[[], T], *, label: str = "") -> T:
        """Run `fn` here; raise `PhaseFailed` on every rank if it raised on any."""
        value: T | None = None
        error: str | None = None
        try:
            value = fn()
        except Exception as err:
            error = short_error(err)
            rank = dist.get_rank() if dist.is_initialized() else 0
            print(
                f"[rank {rank}] {label} failed during {name}:\n{traceback.format_exc()}",
                file=sys.stderr,
                flush=True,
            )
        errors = {rank: e for rank, e in enumerate(self.gather(error)) if e is not None}
        if errors:
            raise PhaseFailed(name, errors)
        return value  # type: ignore[return-value]


def short_error(err: BaseException) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()][:_MAX_LINES]
    text = f"{type(err).__name__}: {' / '.join(lines)}" if lines else type(err).__name__
    return text if len(text) <= _MAX_CHARS else text[: _MAX_CHARS - 3] + "..."
