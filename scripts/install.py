"""Install ddpgraph from this checkout with the PyTorch build that suits this machine.

    python3 scripts/install.py            # then: python3 -m ddpgraph demo

`pip install -e .` alone takes PyTorch from PyPI, whose Linux wheel is the CUDA build
(about 3 GB with its CUDA packages), also on a machine without a GPU. So, before it:

* PyTorch already installed (a GPU image, a conda environment): it is kept as it is;
* Linux without an NVIDIA GPU: the CPU build (about 200 MB), from PyTorch's CPU index,
  at the version CI tests (constraints-cpu.txt);
* otherwise (an NVIDIA GPU, macOS, Windows): PyPI's build, which is the right one there.

Then `pip install -e .` (arguments given to this script replace `-e .`, for example
`-e ".[lightning]"`), with the same Python that runs this script.
"""

from __future__ import annotations

import importlib.util
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def has_nvidia_gpu() -> bool:
    """An NVIDIA driver on this machine: its device files or its `nvidia-smi`."""
    return (
        Path("/proc/driver/nvidia").exists()
        or Path("/dev/nvidia0").exists()
        or shutil.which("nvidia-smi") is not None
    )


def commands(
    package: list[str], *, torch_installed: bool, linux: bool, nvidia: bool
) -> list[list[str]]:
    """The pip commands to run, in order."""
    pip = [sys.executable, "-m", "pip", "install"]
    steps = []
    if not torch_installed and linux and not nvidia:
        steps.append(
            [*pip, "-c", str(ROOT / "constraints-cpu.txt"), "--index-url", CPU_INDEX, "torch"]
        )
    steps.append([*pip, *package])
    return steps


def main(argv: list[str]) -> int:
    package = argv or ["-e", str(ROOT)]
    steps = commands(
        package,
        torch_installed=importlib.util.find_spec("torch") is not None,
        linux=platform.system() == "Linux",
        nvidia=has_nvidia_gpu(),
    )
    for step in steps:
        print("+", " ".join(step), flush=True)
        status = subprocess.call(step)
        if status:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
