"""The graph-safe training pieces a captured step uses, built on the capture core:
fp16 loss scaling decided on the device (`scaler`), a non-finite monitor (`monitor`),
gradient accumulation inside one step (`accumulate`) and checkpoints (`checkpoint`)."""

from __future__ import annotations

from .accumulate import accumulate, split_batch
from .checkpoint import load_training_state, training_state
from .monitor import NonFiniteMonitor, StepValues
from .scaler import GraphSafeGradScaler, ScalerStats, ScalerTensors

__all__ = [
    "GraphSafeGradScaler",
    "NonFiniteMonitor",
    "ScalerStats",
    "ScalerTensors",
    "StepValues",
    "accumulate",
    "load_training_state",
    "split_batch",
    "training_state",
]
