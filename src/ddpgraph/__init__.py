"""ddpgraph: capture a whole DistributedDataParallel training step as one CUDA graph.

    ddp = ddpgraph.prepare_ddp(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4)
    step = ddpgraph.capture_step(train_step, model=ddp, optimizer=opt)
    for x, y in loader:
        loss = step(x, y)   # eager warm-up, one capture, then replays
"""

from ._moved import alias_shadowed
from .backends.graph import (
    CaptureError,
    CudaGraphBackend,
    GraphBackend,
    PassThroughBackend,
    emulation_backend,
)
from .backends.recording import RecordingBackend
from .capture import CapturedStep, StepState, StepStats, capture_step
from .ddp.build import prepare_ddp
from .ddp.distributed import DistInfo, init_distributed
from .errors import DdpGraphError, DdpGraphUsageError, DdpGraphWarning
from .family.buckets import bucket_collate, choose_buckets, pad_to_bucket
from .findings import CATALOG, Code, Finding, Location
from .optimizer.graph_safe import graph_safe_optimizer
from .optimizer.safe_optimizers import GraphSafeOptimizers
from .step.parity import ParityCheck
from .strategies import SelectionReport, StrategyName, TrainStep, TrialSettings, make_step
from .strategies.evaluation import CapturedEval, capture_eval
from .strategies.partial import graph_submodules, partial_report, ungraph_submodules
from .strategies.partial_graphed import PartialReport
from .training.accumulate import accumulate, split_batch
from .training.checkpoint import load_training_state, training_state
from .training.monitor import NonFiniteMonitor, StepValues
from .training.scaler import GraphSafeGradScaler, ScalerStats, ScalerTensors

__version__ = "0.1.0"
# `ddpgraph.accumulate` is the function; its module moved to `ddpgraph.training.accumulate`.
alias_shadowed("ddpgraph.accumulate", "ddpgraph.training.accumulate")
# Integrations import their framework (an optional dependency) only when first used.
_LAZY_SUBMODULES = ("lightning", "accelerate", "transformers")


def __getattr__(name: str) -> object:
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ddpgraph' has no attribute {name!r}")


__all__ = [
    "CATALOG",
    "CaptureError",
    "CapturedEval",
    "CapturedStep",
    "Code",
    "CudaGraphBackend",
    "DdpGraphError",
    "DdpGraphUsageError",
    "DdpGraphWarning",
    "DistInfo",
    "Finding",
    "GraphBackend",
    "GraphSafeGradScaler",
    "GraphSafeOptimizers",
    "Location",
    "NonFiniteMonitor",
    "ParityCheck",
    "PartialReport",
    "PassThroughBackend",
    "RecordingBackend",
    "ScalerStats",
    "ScalerTensors",
    "SelectionReport",
    "StepState",
    "StepStats",
    "StepValues",
    "StrategyName",
    "TrainStep",
    "TrialSettings",
    "__version__",
    "accumulate",
    "bucket_collate",
    "capture_eval",
    "capture_step",
    "choose_buckets",
    "emulation_backend",
    "graph_safe_optimizer",
    "graph_submodules",
    "init_distributed",
    "load_training_state",
    "make_step",
    "pad_to_bucket",
    "partial_report",
    "prepare_ddp",
    "split_batch",
    "training_state",
    "ungraph_submodules",
]
