"""`ddpgraph bench`: one model, every way of running its DDP training step, side by side.

The pieces: `Case` (a workload at a batch size on a device) and `Runner` (one training
step per call) in `case`; the named strategies in `registry` (add your own with
`register_strategy`) and `strategies` (the built-in ones); `measure` runs one strategy
in isolation; `suite` runs them all; `schema`, `table` and `plot` present the results;
`command` is the CLI.
"""

from . import strategies as _builtin  # noqa: F401  (registers the built-in strategies)
from .case import Case, Runner
from .registry import Strategy, register_strategy, registered, select
from .schema import SCHEMA_VERSION, FeedResult, Report, StrategyResult, validate

__all__ = [
    "SCHEMA_VERSION",
    "Case",
    "FeedResult",
    "Report",
    "Runner",
    "Strategy",
    "StrategyResult",
    "register_strategy",
    "registered",
    "select",
    "validate",
]
