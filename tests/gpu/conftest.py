"""GPU tests: real DDP over NCCL, one process per GPU, launched with torchrun.

The world size is `launcher.gpu_world()`: two GPUs where present, one on a one-GPU
machine, or DDPGRAPH_GPU_WORLD. A test that compares ranks is marked `two_ranks` and
skips, with that reason, at world size 1; the rest of each scenario is checked on the
one rank there is.
"""

from __future__ import annotations

import pytest

from launcher import gpu_count, gpu_skip_reason, gpu_world


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "two_ranks: compares two ranks; skipped at world size 1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    world, found = gpu_world(), gpu_count()
    for item in items:
        if "gpu" not in item.keywords:
            continue
        reason = gpu_skip_reason(two_ranks="two_ranks" in item.keywords, world=world, found=found)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
