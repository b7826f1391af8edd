"""What the launching process reads of its place in the job without importing PyTorch
(`ddpgraph.ddp.process`): the rank, and whether there is a GPU to count.

`no_gpu_here` decides from the system, `CUDA_VISIBLE_DEVICES` and the GPU drivers' device
files; the tests point `DEVICE_DIR` at a folder of their own to decide both ways.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ddpgraph.ddp import process


@pytest.fixture
def linux(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A Linux machine whose device files are those the test creates in the folder."""
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(process, "DEVICE_DIR", tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return tmp_path


def test_no_driver_file_means_no_gpu(linux: Path) -> None:
    (linux / "null").touch()
    (linux / "tty0").touch()
    assert process.no_gpu_here()


@pytest.mark.parametrize("device", ["nvidiactl", "nvidia0", "nvidia-uvm", "dxg", "kfd"])
def test_a_driver_file_means_torch_must_be_asked(linux: Path, device: str) -> None:
    (linux / device).touch()
    assert not process.no_gpu_here()


@pytest.mark.parametrize("hidden", ["", "-1"])
def test_cuda_visible_devices_can_hide_every_gpu(
    linux: Path, monkeypatch: pytest.MonkeyPatch, hidden: str
) -> None:
    (linux / "nvidia0").touch()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
    assert process.no_gpu_here()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert not process.no_gpu_here()


@pytest.mark.parametrize("system", ["darwin", "win32"])
def test_other_systems_always_ask_torch(
    linux: Path, monkeypatch: pytest.MonkeyPatch, system: str
) -> None:
    monkeypatch.setattr(sys, "platform", system)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not process.no_gpu_here()


def test_without_a_gpu_torch_is_not_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "no_gpu_here", lambda: True)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` would raise
    assert process.gpu_count() == 0
    assert process.cuda_available() is False


def test_where_a_gpu_may_be_torch_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "no_gpu_here", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert process.gpu_count() == 3 and process.cuda_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert process.gpu_count() == 0 and not process.cuda_available()
    # torch loaded already: asking it costs nothing, and its answer counts.
    monkeypatch.setattr(process, "no_gpu_here", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert process.gpu_count() == 3


def test_the_rank_without_and_with_a_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed", None)  # never imported
    assert process.current_rank() == 0
    group = SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True)
    monkeypatch.setitem(sys.modules, "torch.distributed", group)
    group.get_rank = lambda: 3  # type: ignore[attr-defined]
    assert process.current_rank() == 3
    group.is_initialized = lambda: False  # type: ignore[method-assign]
    assert process.current_rank() == 0


def test_launched_by_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(name, "0")
    assert process.launched_by_torchrun()
    monkeypatch.delenv("LOCAL_RANK")
    assert not process.launched_by_torchrun()
