"""Frozen Python values on GPUs with NCCL and CUDA graphs: the scenarios of
tests/scenarios/cpu_frozen.py (captured with CUDA graphs where a GPU is present), and
`compile=True`, whose compiled forward's Python reads are Dynamo's guards.

Run by tests/gpu/test_frozen_gpu.py under torchrun with one process per GPU.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any

import harness
import torch
import torch.nn.functional as F
from cpu_frozen import SCENARIOS, _batches, _graph_backend, _on
from torch import nn

import ddpgraph
from ddpgraph.ddp.distributed import DistInfo


class Gained(nn.Module):
    """Reads a Python attribute in forward, which Dynamo guards on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 4)
        self.gain = 1.0
        # Three reads deep: past what the plain-value check before each replay follows,
        # so that Dynamo's guard at a check is what sees it change.
        self.opts = types.SimpleNamespace(flags=types.SimpleNamespace(gated=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * self.gain  # frozen: gain
        if self.opts.flags.gated:  # frozen: guarded
            h = h.relu()
        return self.b(h)


def _compiled(
    info: DistInfo,
    *,
    counter: bool,
    change_at: int | None,
    change: Callable[[nn.Module], None] = lambda m: setattr(m.opts.flags, "gated", True),
    calls: int = 40,
    **capture: Any,
) -> dict[str, Any]:
    ddp = ddpgraph.prepare_ddp(Gained().to(info.device))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    state = {"n": 0}

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if counter:
            state["n"] += 1
        scale = 1.0 / state["n"] if counter else 1.0
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y) * scale  # frozen: compiled counter
        loss.backward()
        opt.step()
        return loss.detach()

    step = ddpgraph.capture_step(
        fn, model=ddp, optimizer=opt, compile=True, backend=_graph_backend(), **capture
    )
    states = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(_on(info, _batches(info, calls)), start=1):
            if i == change_at:
                change(ddp.module)
            step(x, y)
            states.append(step.state.value)
    reason = step.reason
    out = {
        "state": step.state.value,
        "code": reason.code.value if reason else None,
        "reason": reason.format() if reason else None,
        "states": states,
        "captures": step.stats.captures,
        "warnings": [str(w.message) for w in caught if "FROZEN_PYTHON_VALUE" in str(w.message)],
        "setting_warnings": [
            str(w.message) for w in caught if "MODULE_SETTING_CHANGED" in str(w.message)
        ],
    }
    step.close()
    return out


def compile_guard_after_capture(info: DistInfo) -> dict[str, Any]:
    """`gated` (a flag read three attributes deep) changes on call 30, after capture: the next
    check runs the compiled forward, whose guard on it fails; the step is captured again."""
    return _compiled(info, counter=False, change_at=30, verify_every=4)


def compile_setting_after_capture(info: DistInfo) -> dict[str, Any]:
    """`gain`, a float setting, changes on call 30: the calls until the next check run
    eagerly (Dynamo recompiles for it there), and the check captures again with it."""
    return _compiled(
        info, counter=False, change_at=30, change=lambda m: setattr(m, "gain", 0.5), verify_every=4
    )


def compile_counter(info: DistInfo) -> dict[str, Any]:
    """A counter in the step, outside the compiled model: refused at the probe."""
    return _compiled(info, counter=True, change_at=None, calls=30)


REGISTRY = {
    **SCENARIOS,
    "compile_guard_after_capture": compile_guard_after_capture,
    "compile_setting_after_capture": compile_setting_after_capture,
    "compile_counter": compile_counter,
}

if __name__ == "__main__":
    harness.run(REGISTRY)
