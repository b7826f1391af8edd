"""Terminal output shared by the commands: one rich console, rank-0 printing, progress."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from ..ddp.process import current_rank


@lru_cache(maxsize=1)
def console() -> Console:
    # Findings contain `[CODE]` and `[ranks 0-1]`, which rich would read as markup.
    return Console(stderr=False, highlight=False, soft_wrap=True, markup=False)


def rank0_print(*objects: object) -> None:
    """Print on rank 0 only: the other ranks would repeat it."""
    if current_rank() == 0:
        console().print(*objects)


class _NoProgress:
    """Stands in for rich's Progress on ranks that print nothing."""

    def add_task(self, description: str, total: float | None = None) -> TaskID:
        return TaskID(0)

    def update(self, task: TaskID, **fields: object) -> None:
        pass

    def advance(self, task: TaskID, advance: float = 1) -> None:
        pass


@contextmanager
def progress_bar(enabled: bool) -> Iterator[Progress | _NoProgress]:
    """A progress bar on rank 0 (to stderr, so piped results stay clean); nothing elsewhere."""
    if not enabled:
        yield _NoProgress()
        return
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(file=sys.stderr),
        transient=True,
    )
    with bar:
        yield bar
