"""A `capture_step` loop that anneals label smoothing through a module-level setting the
loop changes after every step.

The step reads the global when it runs; captured, it would read it once. The doctor
names the line that passes it to torch. GPU (CUDA graphs) or CPU (the recording backend).

    ddpgraph doctor --nproc 2 tests/doctor_scripts/cpu_frozen_global.py
"""

import torch
import torch.nn.functional as F
from common import descend, finish, portable_backend, toy_batches
from torch import nn

import ddpgraph

STEPS = 20
LABEL_SMOOTHING = 0.1


def main() -> None:
    global LABEL_SMOOTHING
    info = ddpgraph.init_distributed()
    torch.manual_seed(0)
    model = ddpgraph.prepare_ddp(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(info.device)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        eps = LABEL_SMOOTHING
        loss = F.cross_entropy(logits, y, label_smoothing=eps)  # doctor: FROZEN_PYTHON_VALUE
        return descend(opt, loss)

    step = ddpgraph.capture_step(train_step, model=model, optimizer=opt, backend=portable_backend())
    for i, (x, y) in enumerate(toy_batches(info.device, STEPS)):
        loss = step(x, y)
        sched.step()
        LABEL_SMOOTHING = max(0.0, 0.1 - 0.002 * (i + 1))
    finish(step, loss, f", label smoothing {LABEL_SMOOTHING:.3f}")


if __name__ == "__main__":
    main()
