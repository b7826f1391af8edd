"""Deprecated path: `ddpgraph.partial` moved to `ddpgraph.strategies.partial`; removed in the next release."""

from ._moved import moved
from .strategies.partial import (
    DEFAULT_TOLERANCE,
    MAX_ATTEMPTS,
    Grapher,
    cuda_grapher,
    graph_recorded,
    graph_submodules,
    partial_report,
    ungraph_submodules,
)
from .strategies.partial_check import relative_difference
from .strategies.partial_graphed import GraphedForward, PartialGraphs, PartialReport, Skipped
from .strategies.partial_record import (
    AutocastState,
    CallRecord,
    SubmoduleRecorder,
    record_forward,
    record_step,
)

moved("ddpgraph.partial", "ddpgraph.strategies.partial")

__all__ = [
    "DEFAULT_TOLERANCE",
    "MAX_ATTEMPTS",
    "AutocastState",
    "CallRecord",
    "GraphedForward",
    "Grapher",
    "PartialGraphs",
    "PartialReport",
    "Skipped",
    "SubmoduleRecorder",
    "cuda_grapher",
    "graph_recorded",
    "graph_submodules",
    "partial_report",
    "record_forward",
    "record_step",
    "relative_difference",
    "ungraph_submodules",
]
