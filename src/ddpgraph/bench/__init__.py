"""`ddpgraph bench`: one model, every way of running its DDP training step, side by side.

The pieces: `Case` (a workload at a batch size on a device) and `Runner` (one training
step per call) in `case`; the named strategies in `registry` (add your own with
`register_strategy`) and `strategies` (the built-in ones); `measure` runs one strategy
in isolation; `suite` runs them all; `schema`, `table` and `plot` present the results.
The command: `command` (its arguments, checked by `choice` without PyTorch, then
torchrun started) and `worker` (what each of its workers runs).

The names below load on first use (`ddpgraph.exports`), so that the command's launching
process, which imports this package for `command`, imports no PyTorch; reading any of
them registers the built-in strategies first.
"""

from typing import TYPE_CHECKING

from ..exports import load_export

if TYPE_CHECKING:  # the names as mypy and editors see them (`X as X`: re-exported)
    from .case import Case as Case
    from .case import Runner as Runner
    from .registry import Strategy as Strategy
    from .registry import register_strategy as register_strategy
    from .registry import registered as registered
    from .registry import select as select
    from .schema import SCHEMA_VERSION as SCHEMA_VERSION
    from .schema import FeedResult as FeedResult
    from .schema import Report as Report
    from .schema import StrategyResult as StrategyResult
    from .schema import validate as validate

# Each public name and the module that defines it.
_EXPORTS = {
    "Case": ".case",
    "Runner": ".case",
    "Strategy": ".registry",
    "register_strategy": ".registry",
    "registered": ".registry",
    "select": ".registry",
    "SCHEMA_VERSION": ".schema",
    "FeedResult": ".schema",
    "Report": ".schema",
    "StrategyResult": ".schema",
    "validate": ".schema",
}

__all__ = sorted(_EXPORTS)


if not TYPE_CHECKING:  # mypy sees the imports above: a misspelt name stays an error there

    def __getattr__(name: str) -> object:
        if name in _EXPORTS:
            from . import strategies  # noqa: F401  (registers the built-in strategies)
        return load_export(__name__, _EXPORTS, name)


def __dir__() -> list[str]:
    return __all__
