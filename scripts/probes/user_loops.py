"""Training loops written as users write them, captured with `capture_step` and compared
with the same loop run eagerly: a pinned multi-worker DataLoader, a scheduler stepped in
the loop, bf16 autocast, clipping, accumulation, a Python counter in the step.

    # one GPU, a few minutes:
    torchrun --standalone --nproc_per_node=1 scripts/probes/user_loops.py [--cases a,b]

Prints one JSON line per case: the step's state and reason, the replays, and how far the
captured run's losses and parameters are from two eager runs of the same loop: with the
optimizer as written, and with it in the graph-safe mode `capture_step` runs it in (the
suite's bit-for-bit reference; the first differs by that mode's rounding). Parameters are
compared per tensor (the largest max|a-b| / max|a|, and the tensor's name) and over the
whole model (||a-b|| / ||a||): AdamW turns rounding noise in a gradient that should be
zero (an attention key's bias, which softmax ignores) into steps of a full learning rate,
so the per-tensor figure can be large where the whole model's is not.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddpgraph

Built = tuple[nn.Module, Callable[[int], DataLoader[Any]], Callable[..., torch.Tensor]]


def _loader(data: TensorDataset, batch: int, **kw: Any) -> Callable[[int], DataLoader[Any]]:
    def make(seed: int) -> DataLoader[Any]:
        gen = torch.Generator().manual_seed(seed)
        return DataLoader(data, batch_size=batch, shuffle=True, drop_last=True, generator=gen, **kw)

    return make


def bert() -> Built:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        vocab_size=8000,
        num_labels=3,
    )
    model = BertForSequenceClassification(config)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randint(0, 8000, (1024, 128), generator=gen),
        torch.randint(0, 3, (1024,), generator=gen),
    )
    loader = _loader(data, 16, num_workers=4, pin_memory=True, persistent_workers=True)

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(input_ids=x).logits.float(), y)

    return model, loader, loss


def vit(drop_path: float = 0.0) -> Built:
    import timm

    model = timm.create_model(
        "vit_tiny_patch16_224", num_classes=10, img_size=96, drop_path_rate=drop_path
    )
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(512, 3, 96, 96, generator=gen), torch.randint(0, 10, (512,), generator=gen)
    )
    loader = _loader(data, 32, num_workers=2, pin_memory=True, prefetch_factor=4)

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(x).float(), y, label_smoothing=0.1)

    return model, loader, loss


def resnet() -> Built:
    import torchvision

    model = torchvision.models.resnet18(num_classes=10).to(memory_format=torch.channels_last)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(512, 3, 64, 64, generator=gen), torch.randint(0, 10, (512,), generator=gen)
    )
    loader = _loader(data, 32, num_workers=4, pin_memory=True)

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(x.to(memory_format=torch.channels_last)).float(), y)

    return model, loader, loss


CASES: dict[str, tuple[Callable[[], Built], str, dict[str, Any]]] = {
    # name: (model and data, optimizer and schedule, step shape)
    "bert_onecycle": (bert, "adamw_onecycle", {}),
    "vit_accumulate": (vit, "adamw_cosine", {"micro_batches": 2}),
    "resnet_sgd": (resnet, "sgd_multistep", {}),
    "bert_counter": (bert, "adamw_onecycle", {"counter": True}),
    # torch's own GradScaler with fp16, as its AMP recipe writes it.
    "resnet_fp16_scaler": (resnet, "sgd_multistep", {"scaler": True}),
    # timm's weight EMA updated inside the step.
    "vit_ema": (vit, "adamw_cosine", {"ema": True}),
    # an eager evaluation of the same model every 10 steps, between training steps.
    "bert_eval_between": (bert, "adamw_onecycle", {"eval_every": 10}),
    # every BatchNorm frozen (eval mode) partway through, as fine-tuning recipes do.
    "resnet_freeze_bn": (resnet, "sgd_multistep", {"freeze_bn_at": 25}),
    # timm's stochastic depth, its rate raised partway through (a ramp by epoch).
    "vit_drop_path_ramp": (lambda: vit(0.05), "adamw_cosine", {"drop_path_at": 25}),
    # a loss weight kept in the script's argparse options, lowered partway through.
    "resnet_args_weight": (resnet, "sgd_multistep", {"weight_at": 25}),
}


def _optimizer(kind: str, model: nn.Module, steps: int) -> tuple[torch.optim.Optimizer, Any]:
    if kind == "sgd_multistep":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4
        )
        return opt, torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[steps // 2], gamma=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    if kind == "adamw_onecycle":
        return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps)
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)


def run(name: str, mode: str, steps: int, info: Any) -> dict[str, Any]:
    """One run of case `name`: `mode` "eager" (the optimizer as written), "safe" (eagerly,
    in the optimizer's graph-safe mode) or "captured"."""
    build, kind, shape = CASES[name]
    torch.manual_seed(0)
    model, make_loader, loss_fn = build()
    ddp = ddpgraph.prepare_ddp(model.to(info.device), device_ids=[info.device.index])
    opt, sched = _optimizer(kind, ddp, steps)
    seen = {"calls": 0}
    args = argparse.Namespace(loss_weight=1.0)
    scaler = torch.amp.GradScaler("cuda") if shape.get("scaler") else None
    ema = None
    if shape.get("ema"):
        from timm.utils import ModelEmaV3

        ema = ModelEmaV3(ddp.module, decay=0.99)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        dtype = torch.float16 if scaler is not None else torch.bfloat16
        with torch.autocast("cuda", dtype=dtype):
            if scaler is not None:
                scaler.scale(loss_fn(ddp, x, y)).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                return torch.zeros(())  # the loss is not this case's point
            if shape.get("micro_batches"):
                loss = ddpgraph.accumulate(
                    ddp,
                    (x, y),
                    lambda a, b: loss_fn(ddp, a, b),
                    micro_batches=shape["micro_batches"],
                )
            else:
                loss = loss_fn(ddp, x, y)
                if shape.get("counter"):
                    # A user's warm-up of the loss scale by a Python counter: frozen if captured.
                    seen["calls"] += 1
                    loss = loss * min(1.0, seen["calls"] / 20)
                if "weight_at" in shape:
                    loss = loss * args.loss_weight
                loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        if ema is not None:
            ema.update(ddp.module)
        return loss.detach()

    step: Any = train_step
    if mode == "captured":
        step = ddpgraph.capture_step(train_step, model=ddp, optimizer=opt)
    elif mode == "safe":
        step = _in_graph_safe_mode(opt, train_step, info.device)
    losses: list[torch.Tensor] = []
    done = 0
    while done < steps:
        for x, y in make_loader(done):
            if done == steps:
                break
            x, y = x.to(info.device, non_blocking=True), y.to(info.device, non_blocking=True)
            losses.append(step(x, y))
            sched.step()
            done += 1
            if done == shape.get("drop_path_at"):
                for module in ddp.modules():
                    if type(module).__name__ == "DropPath":
                        module.drop_prob = 2 * module.drop_prob
            if done == shape.get("weight_at"):
                args.loss_weight = 0.5
            if done == shape.get("freeze_bn_at"):
                for module in ddp.modules():
                    if isinstance(module, nn.BatchNorm2d):
                        module.eval()
            if shape.get("eval_every") and done % shape["eval_every"] == 0:
                ddp.eval()
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    losses.append(loss_fn(ddp, x, y))
                ddp.train()
    torch.cuda.synchronize()
    out: dict[str, Any] = {
        "losses": [float(v) for v in losses],
        "params": {n: p.detach().float().clone() for n, p in ddp.module.named_parameters()}
        | (
            {f"ema.{n}": p.detach().float().clone() for n, p in ema.module.named_parameters()}
            if ema
            else {}
        ),
    }
    if mode == "captured":
        out.update(
            state=step.state.value,
            replays=step.stats.replays,
            reason=step.reason.format().splitlines()[0] if step.reason else None,
        )
        step.close()
    return out


def _in_graph_safe_mode(opt: torch.optim.Optimizer, step: Any, device: Any) -> Any:
    from ddpgraph.optimizer.safe_optimizers import GraphSafeOptimizers

    safe = GraphSafeOptimizers([opt], device)
    assert safe.prepare() is None

    def call(*args: Any) -> Any:
        with safe.installed():
            return step(*args)

    return call


def _diffs(ref: dict[str, Any], graphed: dict[str, Any]) -> dict[str, Any]:
    loss = max(
        abs(a - b) / max(abs(a), 1e-12)
        for a, b in zip(ref["losses"], graphed["losses"], strict=True)
    )
    per_tensor = {
        n: float((a - graphed["params"][n]).abs().max() / a.abs().max().clamp_min(1e-12))
        for n, a in ref["params"].items()
    }
    worst = max(per_tensor, key=per_tensor.__getitem__)
    a = torch.cat([t.flatten() for t in ref["params"].values()])
    b = torch.cat([graphed["params"][n].flatten() for n in ref["params"]])
    return {
        "loss_rel_diff": loss,
        "param_rel_diff": per_tensor[worst],
        "worst_tensor": worst,
        "model_rel_diff": float((a - b).norm() / a.norm()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    info = ddpgraph.init_distributed()
    for name in args.cases.split(","):
        try:
            eager = run(name, "eager", args.steps, info)
            safe = run(name, "safe", args.steps, info)
            graphed = run(name, "captured", args.steps, info)
            line = {
                "case": name,
                **{k: graphed[k] for k in ("state", "replays", "reason")},
                "vs_eager": _diffs(eager, graphed),
                "vs_graph_safe_eager": _diffs(safe, graphed),
                "last_losses": [eager["losses"][-1], graphed["losses"][-1]],
            }
        except Exception as exc:  # a probe reports, it does not stop at the first case
            line = {"case": name, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        if info.rank == 0:
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
