"""The named strategies the benchmark can run, and picking some of them.

A strategy is a name, a one-line summary, and a `build(case, model) -> Runner`, where
`model` is a fresh model on the case's device with the shared initial weights. A slot whose
implementation does not exist yet is registered with `build=None` and the reason, so
it shows up in listings and results instead of being silently absent. Register more
with `register_strategy`.

The built-in names are `make_step`'s (`strategies/names.py`); `names.BUILT_IN_STRATEGIES`
lists them in the registry's order, for the checks made before any strategy is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from ..errors import usage_error
from .case import Case, Runner
from .names import check_strategy_names


@dataclass(frozen=True)
class Strategy:
    name: str
    summary: str
    build: Callable[[Case, nn.Module], Runner] | None
    # Why it does not run on CPU processes; None when it does.
    cpu_skip: str | None = None
    # Why the slot is empty, when `build` is None.
    missing: str | None = None

    @property
    def available(self) -> bool:
        return self.build is not None

    def skip_reason(self, on_cuda: bool) -> str | None:
        """Why this strategy is not run here, or None when it runs."""
        if self.build is None:
            return f"not available yet: {self.missing or 'no implementation registered'}"
        if not on_cuda and self.cpu_skip is not None:
            return self.cpu_skip
        return None


_REGISTRY: dict[str, Strategy] = {}


def register_strategy(strategy: Strategy, *, replace: bool = False) -> Strategy:
    """Add `strategy` to the registry (keeping registration order) and return it."""
    if strategy.name in _REGISTRY and not replace:
        raise usage_error(
            f"`register_strategy({strategy.name!r})`",
            f"a strategy named {strategy.name!r} is already registered",
            "pick another name, or pass `replace=True` to replace it",
        )
    if strategy.build is None and not strategy.missing:
        raise usage_error(
            f"`register_strategy({strategy.name!r})`",
            "expected a `build` function or, for an empty slot, the reason in `missing`",
            "pass `build=...`, or `missing='what is needed'` for a reserved slot",
        )
    _REGISTRY[strategy.name] = strategy
    return strategy


def registered() -> list[Strategy]:
    return list(_REGISTRY.values())


def select(names: Sequence[str] | None) -> list[Strategy]:
    """The strategies named (in registry order), or every available one for None."""
    if names is None:
        return [s for s in _REGISTRY.values() if s.available]
    check_strategy_names(names, list(_REGISTRY))
    wanted = set(names)
    return [s for s in _REGISTRY.values() if s.name in wanted]
