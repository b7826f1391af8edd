"""Deprecated path: `ddpgraph.monitor` moved to `ddpgraph.training.monitor`; removed in the next release."""

from ._moved import moved
from .training.monitor import Action, NonFiniteMonitor, StepValues, nonfinite_finding

moved("ddpgraph.monitor", "ddpgraph.training.monitor")

__all__ = ["Action", "NonFiniteMonitor", "StepValues", "nonfinite_finding"]
