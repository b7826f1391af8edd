"""README's first command, `python3 scripts/install.py`: PyTorch's CPU build on Linux
without an NVIDIA GPU, PyPI's build elsewhere, and a PyTorch already there kept."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install.py"
spec = importlib.util.spec_from_file_location("install_script", SCRIPT)
assert spec is not None and spec.loader is not None
install = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install)
PACKAGE = ["-e", "."]


def test_linux_without_a_gpu_gets_the_cpu_build_at_the_tested_version_first() -> None:
    torch_step, package_step = install.commands(
        PACKAGE, torch_installed=False, linux=True, nvidia=False
    )
    assert torch_step[-3:] == ["--index-url", install.CPU_INDEX, "torch"]
    assert torch_step[torch_step.index("-c") + 1].endswith("constraints-cpu.txt")
    assert package_step[-2:] == PACKAGE


def test_a_gpu_another_system_or_an_installed_torch_keep_pypi_or_what_is_there() -> None:
    for facts in (
        {"torch_installed": False, "linux": True, "nvidia": True},
        {"torch_installed": False, "linux": False, "nvidia": False},
        {"torch_installed": True, "linux": True, "nvidia": False},
    ):
        [only] = install.commands(PACKAGE, **facts)
        assert only[-2:] == PACKAGE and "torch" not in only, facts
