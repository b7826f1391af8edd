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

The names load on first use (`exports`): the `ddpgraph` command's launching process
imports this package, parses its arguments and starts torchrun, and must not pay for
importing PyTorch (about 1.5 s) to do so. `import ddpgraph` alone imports no torch;
`ddpgraph.capture_step` imports what it needs when first read.
"""

from typing import TYPE_CHECKING

from .exports import load_export

if TYPE_CHECKING:  # the names as mypy and editors see them (`X as X`: re-exported)
    from .backends.graph import PassThroughBackend as PassThroughBackend
    from .backends.recording import RecordingBackend as RecordingBackend
    from .capture import CapturedStep as CapturedStep
    from .capture import StepState as StepState
    from .capture import StepStats as StepStats
    from .capture import capture_step as capture_step
    from .ddp.build import prepare_ddp as prepare_ddp
    from .ddp.distributed import init_distributed as init_distributed
    from .errors import DdpGraphError as DdpGraphError
    from .errors import DdpGraphUsageError as DdpGraphUsageError
    from .errors import DdpGraphWarning as DdpGraphWarning
    from .family.buckets import bucket_collate as bucket_collate
    from .family.buckets import pad_to_bucket as pad_to_bucket
    from .findings import Code as Code
    from .findings import Finding as Finding
    from .optimizer.graph_safe import graph_safe_optimizer as graph_safe_optimizer
    from .options import CaptureOptions as CaptureOptions
    from .step.parity import ParityCheck as ParityCheck
    from .strategies.evaluation import capture_eval as capture_eval
    from .strategies.make import make_step as make_step
    from .training.accumulate import accumulate as accumulate
    from .training.accumulate import split_batch as split_batch
    from .training.checkpoint import load_training_state as load_training_state
    from .training.checkpoint import training_state as training_state
    from .training.monitor import NonFiniteMonitor as NonFiniteMonitor
    from .training.scaler import GraphSafeGradScaler as GraphSafeGradScaler

__version__ = "0.1.0"

# Each public name and the module that defines it.
_EXPORTS = {
    "PassThroughBackend": ".backends.graph",
    "RecordingBackend": ".backends.recording",
    "CapturedStep": ".capture",
    "StepState": ".capture",
    "StepStats": ".capture",
    "capture_step": ".capture",
    "prepare_ddp": ".ddp.build",
    "init_distributed": ".ddp.distributed",
    "DdpGraphError": ".errors",
    "DdpGraphUsageError": ".errors",
    "DdpGraphWarning": ".errors",
    "bucket_collate": ".family.buckets",
    "pad_to_bucket": ".family.buckets",
    "Code": ".findings",
    "Finding": ".findings",
    "graph_safe_optimizer": ".optimizer.graph_safe",
    "CaptureOptions": ".options",
    "ParityCheck": ".step.parity",
    "capture_eval": ".strategies.evaluation",
    "make_step": ".strategies.make",
    "accumulate": ".training.accumulate",
    "split_batch": ".training.accumulate",
    "load_training_state": ".training.checkpoint",
    "training_state": ".training.checkpoint",
    "NonFiniteMonitor": ".training.monitor",
    "GraphSafeGradScaler": ".training.scaler",
}

__all__ = sorted([*_EXPORTS, "__version__"])


if not TYPE_CHECKING:  # mypy sees the imports above: a misspelt name stays an error there

    def __getattr__(name: str) -> object:
        return load_export(__name__, _EXPORTS, name)


def __dir__() -> list[str]:
    return __all__
