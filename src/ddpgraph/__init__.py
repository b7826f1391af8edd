"""ddpgraph: capture a whole DistributedDataParallel training step as one CUDA graph.

    ddp = ddpgraph.prepare_ddp(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4)
    step = ddpgraph.capture_step(train_step, model=ddp, optimizer=opt)
    for x, y in loader:
        loss = step(x, y)   # eager warm-up, one capture, then replays
"""

from .accumulate import accumulate, split_batch
from .amp import GraphSafeGradScaler, ScalerStats, ScalerTensors
from .backends import (
    CaptureError,
    CudaGraphBackend,
    GraphBackend,
    PassThroughBackend,
    emulation_backend,
)
from .buckets import bucket_collate, choose_buckets, pad_to_bucket
from .capture import CapturedStep, StepState, StepStats, capture_step
from .checkpoint import load_training_state, training_state
from .ddp import prepare_ddp
from .distributed import DistInfo, init_distributed
from .errors import DdpGraphError, DdpGraphUsageError, DdpGraphWarning
from .evaluation import CapturedEval, capture_eval
from .findings import CATALOG, Code, Finding, Location
from .monitor import NonFiniteMonitor, StepValues
from .optim import graph_safe_optimizer
from .parity import ParityCheck
from .partial import PartialReport, graph_submodules, partial_report, ungraph_submodules
from .recording import RecordingBackend
from .safe_optimizers import GraphSafeOptimizers
from .strategies import SelectionReport, StrategyName, TrainStep, TrialSettings, make_step

__version__ = "0.1.0"
# Integrations import their framework (an optional dependency) only when first used.
_LAZY_SUBMODULES = ("lightning", "accelerate")


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
