"""`ddpgraph doctor --env`: the environment as it bears on capturing DDP training steps.

Versions (PyTorch, CUDA, NCCL), the GPUs and how they are linked, the environment
variables that change distributed or graph behaviour, and which capture features
this installation has. Versions too old to capture are findings (TORCH_TOO_OLD,
NCCL_TOO_OLD, NO_CUDA); the same version checks run in every doctored script.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

import torch

from ..findings import Code, Finding
from .records import finding_to_json

MIN_TORCH = (2, 4)
MIN_NCCL = (2, 9, 6)
# Conditional graph nodes (`torch.cond` inside a graph) need CUDA 12.4.
MIN_CUDA_CONDITIONAL = (12, 4)
VARIABLE_PREFIXES = (
    "NCCL_",
    "TORCH_NCCL_",
    "TORCH_DISTRIBUTED_",
    "TORCH_CUDA",
    "PYTORCH_",
    "CUDA_",
    "CUBLAS_",
    "CUDNN_",
)
VARIABLES = ("OMP_NUM_THREADS", "TORCH_CPP_LOG_LEVEL", "TORCH_LOGS", "TORCHINDUCTOR_CUDAGRAPHS")
SCHEMA = "ddpgraph.doctor.env/1"


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """`2.11.0+cu130` -> (2, 11, 0); None for None or text without a version."""
    if not text:
        return None
    match = re.match(r"(\d+(?:\.\d+)*)", str(text))
    return tuple(int(x) for x in match.group(1).split(".")) if match else None


def nccl_version() -> tuple[int, ...] | None:
    """NCCL's version as PyTorch reports it, or None without CUDA or NCCL."""
    try:
        if not torch.cuda.is_available():
            return None
        import torch.cuda.nccl as nccl

        return tuple(int(x) for x in nccl.version()[:3])
    except Exception:  # a build without NCCL
        return None


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(x) for x in version)


def version_findings(
    torch_version: tuple[int, ...] | None, nccl: tuple[int, ...] | None
) -> list[Finding]:
    """TORCH_TOO_OLD and NCCL_TOO_OLD for the versions given (None: unknown, no finding)."""
    found = []
    if torch_version is not None and torch_version[:2] < MIN_TORCH:
        found.append(
            Finding(
                Code.TORCH_TOO_OLD,
                f"PyTorch {_dotted(torch_version)} is installed; capturing a DDP step needs "
                f"{_dotted(MIN_TORCH)} or newer",
                subject="PyTorch",
            )
        )
    if nccl is not None and nccl < MIN_NCCL:
        found.append(
            Finding(
                Code.NCCL_TOO_OLD,
                f"NCCL {_dotted(nccl)} is in use; collectives can be captured from NCCL "
                f"{_dotted(MIN_NCCL)} on",
                subject="NCCL",
            )
        )
    return found


def installed_version_findings() -> list[Finding]:
    """Version findings for this process, touching CUDA only if the script already did."""
    nccl = nccl_version() if torch.cuda.is_initialized() else None
    return version_findings(parse_version(torch.__version__), nccl)


@dataclass(frozen=True)
class Feature:
    name: str
    available: bool
    detail: str


@dataclass
class EnvReport:
    versions: dict[str, str | None]
    gpus: list[dict[str, Any]]
    topology: str | None
    variables: dict[str, str]
    features: list[Feature]
    findings: list[Finding] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "versions": self.versions,
            "gpus": self.gpus,
            "topology": self.topology,
            "variables": self.variables,
            "features": [vars(f) for f in self.features],
            "findings": [finding_to_json(f) for f in self.findings],
        }


def collect() -> EnvReport:
    cuda = torch.cuda.is_available()
    nccl = nccl_version()
    versions: dict[str, str | None] = {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda,
        "cudnn": str(torch.backends.cudnn.version()) if cuda else None,
        "nccl": _dotted(nccl) if nccl else None,
        "driver": _driver_version() if cuda else None,
    }
    findings = version_findings(parse_version(torch.__version__), nccl)
    if not cuda:
        findings.append(
            Finding(
                Code.NO_CUDA,
                "torch.cuda.is_available() is False: CUDA graphs cannot be captured here "
                f"(PyTorch {torch.__version__})",
                subject="CUDA",
            )
        )
    return EnvReport(
        versions=versions,
        gpus=_gpus() if cuda else [],
        topology=_topology() if cuda else None,
        variables=relevant_variables(os.environ),
        features=features(cuda, nccl),
        findings=findings,
    )


def relevant_variables(environ: Any) -> dict[str, str]:
    return {
        k: str(v)
        for k, v in sorted(environ.items())
        if k.startswith(VARIABLE_PREFIXES) or k in VARIABLES
    }


def features(cuda: bool, nccl: tuple[int, ...] | None) -> list[Feature]:
    cuda_runtime = parse_version(torch.version.cuda)
    count = torch.cuda.device_count() if cuda else 0
    conditional_api = (
        importlib.util.find_spec("torch._higher_order_ops.cudagraph_conditional_nodes") is not None
    )
    return [
        Feature("CUDA graphs", count > 0, f"{count} GPU(s)" if cuda else "no CUDA device"),
        Feature(
            "NCCL collectives inside graphs",
            nccl is not None and nccl >= MIN_NCCL,
            f"NCCL {_dotted(nccl)}" if nccl else "no NCCL",
        ),
        Feature(
            "capturable optimizers (capturable=True)",
            "capturable" in inspect.signature(torch.optim.AdamW.__init__).parameters,
            "Adam/AdamW keep their step count on the GPU",
        ),
        Feature(
            "learning rate in a device tensor",
            _tensor_lr_supported(),
            "a scheduler's updates reach the graph",
        ),
        Feature(
            "fused SGD",
            "fused" in inspect.signature(torch.optim.SGD.__init__).parameters,
            "SGD's fused kernel reads a tensor learning rate",
        ),
        Feature(
            "conditional nodes (torch.cond inside a graph)",
            conditional_api and cuda_runtime is not None and cuda_runtime >= MIN_CUDA_CONDITIONAL,
            f"CUDA {torch.version.cuda or 'none'}; needs {_dotted(MIN_CUDA_CONDITIONAL)}",
        ),
        Feature(
            "stale-stream check in autograd",
            hasattr(torch.autograd.graph, "set_override_stale_capture_stream"),
            "backward names DDP built on the default stream instead of breaking the capture",
        ),
        Feature(
            "CUDA sync debug mode",
            hasattr(torch.cuda, "set_sync_debug_mode"),
            "the doctor's host-synchronisation probe",
        ),
    ]


def _tensor_lr_supported() -> bool:
    try:
        param = torch.zeros(1, requires_grad=True)
        torch.optim.AdamW([param], lr=torch.tensor(1e-3), capturable=True)
    except Exception:
        return False
    return True


def _gpus() -> list[dict[str, Any]]:
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(
            {
                "index": index,
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1),
            }
        )
    return gpus


def _run(args: list[str]) -> str | None:
    if shutil.which(args[0]) is None:
        return None
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _topology() -> str | None:
    return _run(["nvidia-smi", "topo", "-m"])


def _driver_version() -> str | None:
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None
