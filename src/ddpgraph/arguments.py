"""Deprecated path: `ddpgraph.arguments` moved to `ddpgraph.app.arguments`; removed in the next release."""

from ._moved import moved
from .app.arguments import USAGE_EXIT, at_least, output_file, process_count, report

moved("ddpgraph.arguments", "ddpgraph.app.arguments")

__all__ = ["USAGE_EXIT", "at_least", "output_file", "process_count", "report"]
