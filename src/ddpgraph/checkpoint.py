"""Deprecated path: `ddpgraph.checkpoint` moved to `ddpgraph.training.checkpoint`; removed in the next release."""

from ._moved import moved
from .training.checkpoint import T, load_training_state, training_state

moved("ddpgraph.checkpoint", "ddpgraph.training.checkpoint")

__all__ = ["T", "load_training_state", "training_state"]
