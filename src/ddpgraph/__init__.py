"""ddpgraph: capture a whole DistributedDataParallel training step as one CUDA graph.

    ddp = ddpgraph.prepare_ddp(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4)
    step = ddpgraph.capture_step(train_step, model=ddp, optimizer=opt)
    for x, y in loader:
        loss = step(x, y)   # eager warm-up, one capture, then replays
"""

from .backends import CaptureError, CudaGraphBackend, GraphBackend, PassThroughBackend
from .capture import CapturedStep, StepState, StepStats, capture_step
from .ddp import prepare_ddp
from .distributed import DistInfo, init_distributed
from .errors import DdpGraphError, DdpGraphUsageError, DdpGraphWarning
from .findings import CATALOG, Code, Finding, Location
from .optim import graph_safe_optimizer

__version__ = "0.1.0"

__all__ = [
    "CATALOG",
    "CaptureError",
    "CapturedStep",
    "Code",
    "CudaGraphBackend",
    "DdpGraphError",
    "DdpGraphUsageError",
    "DdpGraphWarning",
    "DistInfo",
    "Finding",
    "GraphBackend",
    "Location",
    "PassThroughBackend",
    "StepState",
    "StepStats",
    "__version__",
    "capture_step",
    "graph_safe_optimizer",
    "init_distributed",
    "prepare_ddp",
]
