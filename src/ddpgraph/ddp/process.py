"""The process's place in a job, read without importing PyTorch: whether torchrun started
it, its rank, and the GPUs it could use.

The `ddpgraph` command's launching process reads these before it starts torchrun, and
never runs a tensor operation: importing torch there would cost about 1.5 s on every
`ddpgraph --help`. So nothing here imports torch where the answer is known without it:
the rank of a process that never imported `torch.distributed` is 0 (it has no process
group), and on Linux a machine without any GPU driver's device file, or a process whose
`CUDA_VISIBLE_DEVICES` hides every device, has no GPU to count. Everywhere else torch is
asked, and its answer is the one these functions give.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

# The device files of the drivers that torch.cuda serves: NVIDIA's (`/dev/nvidiactl`,
# `/dev/nvidia0`...), WSL2's GPU paravirtualisation, and ROCm's (HIP builds of torch
# answer through torch.cuda too).
DEVICE_DIR = Path("/dev")
DRIVER_FILES = ("nvidia*", "dxg", "kfd")
# CUDA_VISIBLE_DEVICES values that hide every device.
NO_DEVICES = ("", "-1")


def launched_by_torchrun() -> bool:
    """True inside a worker that torchrun (or another launcher setting its variables) started."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def current_rank() -> int:
    """This process's rank in the default process group, 0 without one."""
    # A process that never imported torch.distributed has no process group.
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return int(dist.get_rank())


def no_gpu_here() -> bool:
    """Certainly no GPU this process could use, known without PyTorch: on Linux, with
    `CUDA_VISIBLE_DEVICES` set to hide every device, or without any GPU driver's device
    file. False where it cannot tell (other systems, a driver present)."""
    if not sys.platform.startswith("linux"):
        return False
    if os.environ.get("CUDA_VISIBLE_DEVICES") in NO_DEVICES:
        return True
    return not any(any(DEVICE_DIR.glob(pattern)) for pattern in DRIVER_FILES)


def _torch_cuda() -> ModuleType | None:
    """`torch.cuda`, or None where `no_gpu_here()` and torch was never imported. Where
    torch is loaded already, asking it costs nothing, and its answer counts (a test may
    have replaced it)."""
    if sys.modules.get("torch") is None and no_gpu_here():
        return None
    import torch

    return torch.cuda


def cuda_available() -> bool:
    """`torch.cuda.is_available()`, without importing torch where there is no GPU."""
    cuda = _torch_cuda()
    return cuda is not None and bool(cuda.is_available())


def gpu_count() -> int:
    """The GPUs this process could use: `torch.cuda.device_count()` where CUDA is
    available, else 0; without importing torch where there is no GPU."""
    cuda = _torch_cuda()
    return int(cuda.device_count()) if cuda is not None and cuda.is_available() else 0
