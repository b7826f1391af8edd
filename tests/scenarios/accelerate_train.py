"""Hugging Face Accelerate: `accelerator.prepare(...)`, then `ddpgraph.capture_step` with
`accelerator.backward(loss)` inside the step, against the same prepared objects trained
eagerly with the same graph-safe optimizer. On gloo CPU processes with the stand-in
backend (tests/dist/test_accelerate_gloo.py) or one process per GPU with CUDA graphs
(tests/gpu/test_accelerate_gpu.py). Accelerate joins the process group the harness opened.
"""

from __future__ import annotations

from typing import Any

import harness
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddpgraph
from ddpgraph.ddp.distributed import DistInfo

STEPS_PER_RANK = 24


def _prepared(info: DistInfo, **accelerator_kw: Any):
    # Accelerate keeps its state in process-wide singletons: start each run afresh.
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=info.device.type == "cpu", **accelerator_kw)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(8 * STEPS_PER_RANK * info.world_size, 16, generator=gen)
    loader = DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=8, drop_last=True)
    return accelerator, *accelerator.prepare(model, opt, loader, sched)


def _train(
    info: DistInfo,
    *,
    capture: bool,
    graph_safe: bool = True,
    clip: bool = False,
    **accelerator_kw: Any,
) -> dict[str, Any]:
    accelerator, model, opt, loader, sched = _prepared(info, **accelerator_kw)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with accelerator.accumulate(model):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            if clip:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
        return loss.detach()

    on_cpu = info.device.type == "cpu"
    step: Any = train_step
    if capture:
        backend = ddpgraph.PassThroughBackend() if on_cpu else None
        step = ddpgraph.capture_step(train_step, model=model, optimizer=opt, backend=backend)
    elif graph_safe:  # as capture_step runs its eager steps: the graph-safe mode installed
        step = harness.with_same_settings(opt.optimizer, train_step, info.device)
    losses, lrs = [], []
    for x, y in loader:
        losses.append(float(step(x, y)))
        sched.step()
        lrs.append(float(opt.param_groups[0]["lr"]))
    result = {"losses": losses, "lrs": lrs, "params": harness.params_of(model)}
    if capture:
        result.update(
            state=step.state.value,
            code=step.reason.code.value if step.reason else None,
            reason=step.reason.format() if step.reason else None,
            stats=dict(vars(step.stats)),
        )
        step.close()
    return result


def _compare(info: DistInfo, *, refused: bool = False, **kw: Any) -> dict[str, Any]:
    graphed = _train(info, capture=True, **kw)
    # A refused step leaves the optimizer as the user made it.
    plain = _train(info, capture=False, graph_safe=not refused, **kw)
    return {
        **{k: graphed[k] for k in ("state", "code", "reason", "stats", "lrs")},
        "steps": len(graphed["losses"]),
        "same_losses": plain["losses"] == graphed["losses"],
        "same_lrs": plain["lrs"] == graphed["lrs"],
        "param_rel_diff": harness.rel_diff(plain["params"], graphed["params"]),
        "loss_rel_diff": harness.loss_rel_diff(plain["losses"], graphed["losses"]),
    }


REGISTRY: dict[str, harness.Scenario] = {
    "fp32": lambda info: _compare(info),
    "bf16": lambda info: _compare(info, mixed_precision="bf16"),
    "clipping": lambda info: _compare(info, clip=True),
    "accumulate": lambda info: _compare(info, refused=True, gradient_accumulation_steps=2),
}

if __name__ == "__main__":
    harness.run(REGISTRY)
