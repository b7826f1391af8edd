"""fp16 training with `torch.amp.GradScaler`, whose step is captured with the rest.

`scaler.step` reads the found-inf flag on the host to decide whether to step, which
cannot be recorded. The doctor names GRAD_SCALER_IN_CAPTURE at `scaler.step(opt)`.

    torchrun --nproc_per_node=2 tests/doctor_scripts/grad_scaler.py
    ddpgraph doctor --nproc 2 tests/doctor_scripts/grad_scaler.py
"""

import torch
import torch.nn.functional as F
from common import batch, capture, make_model, setup, side_stream_ddp, teardown, warm_up


def main() -> None:
    _, device = setup()
    s, ddp = side_stream_ddp(make_model(device), device)
    opt = torch.optim.AdamW(ddp.parameters(), lr=torch.tensor(1e-3, device=device), capturable=True)
    scaler = torch.amp.GradScaler("cuda")
    static_x, static_y = batch(device)

    def train_step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(ddp(static_x), static_y)
        scaler.scale(loss).backward()
        scaler.step(opt)  # doctor: GRAD_SCALER_IN_CAPTURE
        scaler.update()
        return loss.detach()

    warm_up(train_step, s)
    g, static_loss = capture(train_step, s)
    for _ in range(5):
        g.replay()
    print(static_loss)
    teardown(g)


if __name__ == "__main__":
    main()
