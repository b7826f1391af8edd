"""Families of graphs on GPUs: a language model trained on variable sequence lengths,
padded to buckets, with `capture_step(max_graphs=4)`, against the same run eagerly;
and the memory of the family's shared pool against that of its largest graph.

Run by tests/gpu/test_family_gpu.py under torchrun with one process per GPU (1 or 2).
"""

from __future__ import annotations

import copy
from typing import Any

import harness
import torch
import torch.nn.functional as F
from torch import nn

import ddpgraph
from ddpgraph.app.models import GPTConfig, TinyGPT
from ddpgraph.ddp.distributed import DistInfo

BUCKETS = (64, 128, 256, 512)
CFG = GPTConfig(vocab=1000, block=512, layers=2, dim=128, heads=4)


def _batches(
    info: DistInfo, n: int, lengths: list[int] | None = None
) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11 + info.rank)  # each rank its own lengths
    lengths = lengths or [int(v) for v in torch.randint(64, 513, (n,), generator=gen)]
    out = []
    for t in lengths:
        ids = torch.randint(1, CFG.vocab, (4, t), generator=gen)
        batch = ddpgraph.pad_to_bucket({"input_ids": ids, "labels": ids.clone()}, BUCKETS)
        out.append(
            {"ids": batch["input_ids"].to(info.device), "labels": batch["labels"].to(info.device)}
        )
    return out


def _setup(info: DistInfo) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    ddp = ddpgraph.prepare_ddp(TinyGPT(CFG).to(info.device), device_ids=[info.device.index])
    opt = ddpgraph.graph_safe_optimizer(
        torch.optim.AdamW(ddp.parameters(), lr=1e-3, capturable=True)
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    return ddp, opt, sched


def _step_fn(ddp: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator):
    def train_step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            logits = ddp(ids)
        # Dropout draws from the default generator, the noise from a generator of its own.
        logits = F.dropout(logits.float(), 0.1)
        noise = 1e-3 * torch.randn((), device=ids.device, generator=gen)
        loss = (
            F.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
            )
            + noise
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        return loss.detach()

    return train_step


def _train(
    info: DistInfo, batches: list[dict[str, torch.Tensor]], captured: bool, **kw: Any
) -> dict[str, Any]:
    ddp, opt, sched = _setup(info)
    gen = torch.Generator(device=info.device).manual_seed(5)
    fn = _step_fn(ddp, opt, gen)
    step: Any = (
        ddpgraph.capture_step(fn, model=ddp, optimizer=opt, generators=[gen], **kw)
        if captured
        else fn
    )
    losses, saved = [], None
    torch.manual_seed(1)
    for i, b in enumerate(batches):
        if i == 20:  # a checkpoint, loaded back ten steps later: every graph must see it
            saved = copy.deepcopy((ddp.module.state_dict(), opt.state_dict()))
        if i == 30 and saved is not None:
            ddp.module.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
        losses.append(float(step(b["ids"], b["labels"])))
        sched.step()
    result: dict[str, Any] = {"losses": losses, "params": harness.params_of(ddp)}
    if captured:
        result["stats"] = copy.deepcopy(vars(step.stats))
        result["state"] = step.state.value
        step.close()
    return result


def varlen_equivalence(info: DistInfo) -> dict[str, Any]:
    batches = _batches(info, 60)
    ref = _train(info, batches, captured=False)
    # agree_every: with 2 GPUs, graphs are added on decision points only.
    got = _train(info, batches, captured=True, max_graphs=4, agree_every=4)
    return {
        "state": got["state"],
        "stats": got["stats"],
        "lengths": [int(b["ids"].shape[1]) for b in batches],
        "loss_rel_diff": harness.loss_rel_diff(ref["losses"], got["losses"]),
        "param_rel_diff": harness.rel_diff(ref["params"], got["params"]),
        "bitwise": ref["losses"] == got["losses"]
        and harness.rel_diff(ref["params"], got["params"]) == 0.0,
    }


def pool_memory(info: DistInfo) -> dict[str, Any]:
    """The family's pool after graphs for every bucket, against a pool holding only the
    graph of the largest bucket."""
    cycle = [64, 128, 256, 512] * 6  # smallest first: the worst order for reuse
    family = _train(
        info, _batches(info, 0, [512] * 11 + cycle), captured=True, max_graphs=4, agree_every=1
    )
    largest = _train(
        info, _batches(info, 0, [512] * 14), captured=True, max_graphs=2, agree_every=1
    )
    return {"family": family["stats"], "largest": largest["stats"]}


REGISTRY = {"varlen_equivalence": varlen_equivalence, "pool_memory": pool_memory}

if __name__ == "__main__":
    harness.run(REGISTRY)
