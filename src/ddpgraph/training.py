"""Deprecated path of `ddpgraph.reference_step`."""

from ._moved import moved
from .reference_step import StepOptions, Timing, make_train_step
from .streams import synchronize

moved("ddpgraph.training", "ddpgraph.reference_step")

__all__ = ["StepOptions", "Timing", "make_train_step", "synchronize"]
