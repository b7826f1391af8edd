"""GPU tests: real DDP over NCCL, one process per GPU, launched with torchrun."""

from __future__ import annotations

import pytest
import torch

from launcher import gpu_world


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_count() >= gpu_world():
        return
    skip = pytest.mark.skip(reason=f"needs {gpu_world()} CUDA GPUs, found {gpu_count()}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
