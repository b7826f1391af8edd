"""Deprecated path: `ddpgraph.report` moved to `ddpgraph.app.console`; removed in the next release."""

from ._moved import moved
from .app.console import console, progress_bar, rank0_print

moved("ddpgraph.report", "ddpgraph.app.console")

__all__ = ["console", "progress_bar", "rank0_print"]
