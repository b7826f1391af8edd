"""ddpgraph: capture a whole DistributedDataParallel training step as one CUDA graph.

    ddp = ddpgraph.prepare_ddp(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4)
    step = ddpgraph.capture_step(train_step, model=ddp, optimizer=opt)
    for x, y in loader:
        loss = step(x, y)   # eager warm-up, one capture, then replays

The root holds what a training script calls, catches or reads; everything else stays
importable from the module that defines it. The framework integrations import their
framework (an optional dependency), so they are imported by path only:
`from ddpgraph.integrations.lightning import CUDAGraphCallback`.
"""

from .backends.graph import PassThroughBackend
from .backends.recording import RecordingBackend
from .capture import CapturedStep, StepState, StepStats, capture_step
from .ddp.build import prepare_ddp
from .ddp.distributed import init_distributed
from .errors import DdpGraphError, DdpGraphUsageError, DdpGraphWarning
from .family.buckets import bucket_collate, pad_to_bucket
from .findings import Code, Finding
from .optimizer.graph_safe import graph_safe_optimizer
from .options import CaptureOptions
from .step.parity import ParityCheck
from .strategies.evaluation import capture_eval
from .strategies.make import make_step
from .training.accumulate import accumulate, split_batch
from .training.checkpoint import load_training_state, training_state
from .training.monitor import NonFiniteMonitor
from .training.scaler import GraphSafeGradScaler

__version__ = "0.1.0"

__all__ = [
    "CaptureOptions",
    "CapturedStep",
    "Code",
    "DdpGraphError",
    "DdpGraphUsageError",
    "DdpGraphWarning",
    "Finding",
    "GraphSafeGradScaler",
    "NonFiniteMonitor",
    "ParityCheck",
    "PassThroughBackend",
    "RecordingBackend",
    "StepState",
    "StepStats",
    "__version__",
    "accumulate",
    "bucket_collate",
    "capture_eval",
    "capture_step",
    "graph_safe_optimizer",
    "init_distributed",
    "load_training_state",
    "make_step",
    "pad_to_bucket",
    "prepare_ddp",
    "split_batch",
    "training_state",
]
