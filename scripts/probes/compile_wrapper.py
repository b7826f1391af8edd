"""What the value watch costs a `torch.compile` wrapper around DDP (`torch.compile(ddp)`,
as transformers' Trainer makes with `torch_compile=True`) during `capture_step`'s warm-up.

    # one GPU, about a minute each:
    torchrun --standalone --nproc_per_node=1 scripts/probes/compile_wrapper.py
    torchrun --standalone --nproc_per_node=1 scripts/probes/compile_wrapper.py --watch-on-stack

The watched warm-up steps run under a `TorchFunctionMode`; Dynamo guards on the mode
stack, so a compiled frame entered with the mode on it is compiled again. The watch steps
out of the wrapper; `--watch-on-stack` leaves it on (ddpgraph's behaviour before that),
for the comparison. Prints the seconds until the step is captured, the graphs Dynamo
made, the guard failures that name the mode stack, and the last loss.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import ddpgraph
from ddpgraph.frozen.value_checks import ValueChecks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--watch-on-stack", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    if args.watch_on_stack:
        ValueChecks.also_outside = lambda self, wrapper: None  # type: ignore[method-assign]
    info = ddpgraph.init_distributed()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=384, n_head=6, vocab_size=8192)
    model = GPT2LMHeadModel(config).to(info.device)  # type: ignore[arg-type]
    ddp = ddpgraph.prepare_ddp(model, device_ids=[info.device.index])
    compiled = cast(nn.Module, torch.compile(ddp))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, capturable=True)

    def train_step(ids: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = compiled(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        return loss.detach()

    step = ddpgraph.capture_step(train_step, model=compiled, optimizer=opt, compile=True)
    gen = torch.Generator(device=info.device).manual_seed(1)
    start, captured_at, loss = time.perf_counter(), None, None
    for i in range(args.steps):
        ids = torch.randint(0, 8192, (8, 256), device=info.device, generator=gen)
        loss = step(ids)
        torch.cuda.synchronize()
        if captured_at is None and step.state is ddpgraph.StepState.CAPTURED:
            captured_at = (i + 1, time.perf_counter() - start)
    failures = [
        str(r)
        for reasons in torch._dynamo.utils.guard_failures.values()
        for r in reasons
        if "torch_function_mode_stack" in str(r)
    ]
    if info.is_main:
        print(
            json.dumps(
                {
                    "watch_on_stack": args.watch_on_stack,
                    "state": step.state.value,
                    "captured_at_step": captured_at[0] if captured_at else None,
                    "seconds_to_capture": round(captured_at[1], 2) if captured_at else None,
                    "seconds_total": round(time.perf_counter() - start, 2),
                    "unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                    "mode_stack_guard_failures": len(failures),
                    "last_loss": float(loss) if loss is not None else None,
                    "stats": dict(vars(step.stats)),
                }
            )
        )
    step.close()


if __name__ == "__main__":
    main()
