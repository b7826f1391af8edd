"""Deprecated path: `ddpgraph.amp` moved to `ddpgraph.training.scaler`; removed in the next release."""

from ._moved import moved
from .training.scaler import GraphSafeGradScaler, ScalerStats, ScalerTensors

moved("ddpgraph.amp", "ddpgraph.training.scaler")

__all__ = ["GraphSafeGradScaler", "ScalerStats", "ScalerTensors"]
