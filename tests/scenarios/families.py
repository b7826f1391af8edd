"""Model families beyond the first four, each trained by `capture_step` and, from the same
state on the same batches, eagerly with the same graph-safe optimizer: a BERT masked
language model with padding and its attention mask, a Mixtral mixture of experts (the
default grouped routing, bf16 weights, and the per-expert loop), a CNN with
SyncBatchNorm, and a GPT-2 with activation checkpointing (non-reentrant and reentrant)
and dropout. The same scenarios run on gloo CPU processes with the recording backend
(tests/dist/test_families_gloo.py, models built small) and one process per GPU with the
bench presets' sizes (tests/gpu/test_families_gpu.py).

On CPU, transformers cannot learn that the recording backend records: where it asks
whether a CUDA stream captures before reading a mask on the host, the CPU scenarios
give it the answer a CUDA capture gives (`capture_branch`), in the captured and the
eager run alike; `bert_as_called` shows what the recording makes of the other branch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any
from unittest import mock

import harness
import torch
from syncbn_cpu import cpu_sync_batch_norm
from torch import nn

import ddpgraph
from ddpgraph.app.models import SmallResNet, Workload, cnn_workload
from ddpgraph.app.reference_step import StepOptions, make_train_step
from ddpgraph.bench import family_presets as fp
from ddpgraph.bench.workloads import resolve_model
from ddpgraph.ddp.distributed import DistInfo

TINY_BERT = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 1100,
}
TINY_MIXTRAL = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 96,
}
TINY_GPT2 = {
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 2,
    "vocab_size": 96,
    "resid_pdrop": 0.1,
    "embd_pdrop": 0.1,
    "attn_pdrop": 0.1,
}
CPU_SEQ, CPU_BATCH, GPU_BATCH, STEPS = 16, 4, 2, 14


def _cpu(info: DistInfo) -> bool:
    return info.device.type == "cpu"


def _workload(name: str, info: DistInfo) -> Workload:
    cpu = _cpu(info)
    if name in ("bert", "bert_as_called"):
        return fp.hf_bert(CPU_SEQ, **TINY_BERT) if cpu else resolve_model("hf-bert").workload
    if name == "moe":
        return fp.hf_moe(CPU_SEQ, **TINY_MIXTRAL) if cpu else resolve_model("hf-moe").workload
    if name == "moe_bf16":
        return (
            fp.hf_moe(CPU_SEQ, dtype=torch.bfloat16, **TINY_MIXTRAL)
            if cpu
            else resolve_model("hf-moe-bf16").workload
        )
    if name == "moe_eager_experts":
        return fp.hf_moe(CPU_SEQ, experts_implementation="eager", **(TINY_MIXTRAL if cpu else {}))
    if name == "syncbn":
        if not cpu:
            return resolve_model("tv-syncbn").workload
        # BatchNorm here, converted once DDP is built (`_run`): DDP refuses SyncBatchNorm
        # in a CPU model when it is built.
        images = cnn_workload(image=16, classes=10)
        return Workload(
            "syncbn", lambda: SmallResNet(10, width=8), images.make_batch, images.loss, "images"
        )
    reentrant = name == "ckpt_reentrant"
    return (
        fp.hf_gpt2_ckpt(CPU_SEQ, reentrant=reentrant, **TINY_GPT2)
        if cpu
        else fp.hf_gpt2_ckpt(reentrant=reentrant)
    )


def capture_branch() -> AbstractContextManager[Any]:
    """transformers' mask builders told that a CUDA stream captures (`is_tracing`), the
    branch a CUDA capture records."""
    return mock.patch("transformers.masking_utils.is_tracing", return_value=True)


def _run(
    info: DistInfo,
    workload: Workload,
    batches: list[Any],
    *,
    captured: bool,
    ddp_kw: dict[str, Any],
    context: Callable[[Any], AbstractContextManager[Any]],
    convert: bool = True,
) -> dict[str, Any]:
    torch.manual_seed(0)
    ids = {"device_ids": [info.device.index]} if info.device.type == "cuda" else {}
    ddp = ddpgraph.prepare_ddp(workload.build().to(info.device), **ids, **ddp_kw)
    if workload.name == "syncbn" and convert:
        nn.SyncBatchNorm.convert_sync_batchnorm(
            ddp.module
        )  # in place: the same parameters and buffers
    opt = torch.optim.AdamW(
        ddp.parameters(), lr=1e-3, **harness.optimizer_kwargs(torch.optim.AdamW)
    )
    options = StepOptions(amp_dtype=None if _cpu(info) else torch.bfloat16, clip_norm=1.0)
    fn = make_train_step(ddp, opt, workload.loss, options)
    backend = harness.backend() if _cpu(info) else None
    step: Any = (
        ddpgraph.capture_step(fn, model=ddp, optimizer=opt, backend=backend)
        if captured
        else harness.with_same_settings(opt, fn, info.device)
    )
    torch.manual_seed(1)  # dropout's numbers, the same in both runs
    with context(backend):
        losses = [float(step(x, y)) for x, y in batches]
    if info.device.type == "cuda":
        torch.cuda.synchronize()
    out: dict[str, Any] = {
        "losses": losses,
        "params": harness.params_of(ddp),
        "buffers": [b.detach().clone() for b in ddp.buffers()],
    }
    if captured:
        out.update(
            state=step.state.value,
            code=step.reason.code.value if step.reason else None,
            reason=step.reason.format() if step.reason else None,
            stats=dict(vars(step.stats)),
            collectives=sorted(set(getattr(getattr(backend, "last", None), "collectives", []))),
        )
        step.close()
    return out


def compare(info: DistInfo, name: str) -> dict[str, Any]:
    workload = _workload(name, info)
    gen = torch.Generator().manual_seed(21 + info.rank)
    size = CPU_BATCH if _cpu(info) else GPU_BATCH
    batches = [workload.make_batch(size, gen, info.device) for _ in range(STEPS)]
    ddp_kw: dict[str, Any] = {}
    if name == "moe_eager_experts":  # an expert no token chose has no gradient
        ddp_kw = {"find_unused_parameters": True}
    elif name == "syncbn":  # every rank's running statistics are the same: nothing to broadcast
        ddp_kw = {"broadcast_buffers": False}
    context: Callable[[Any], AbstractContextManager[Any]] = lambda backend: nullcontext()  # noqa: E731
    if _cpu(info) and name == "syncbn":
        context = cpu_sync_batch_norm
    elif _cpu(info) and name != "bert_as_called":
        context = lambda backend: capture_branch()  # noqa: E731
    graphed = _run(info, workload, batches, captured=True, ddp_kw=ddp_kw, context=context)
    eager = _run(info, workload, batches, captured=False, ddp_kw=ddp_kw, context=context)
    result: dict[str, Any] = {}
    if not _cpu(info):  # how far eager is from itself (a kernel that is not deterministic)
        control = _run(info, workload, batches, captured=False, ddp_kw=ddp_kw, context=context)
        result["control_rel_diff"] = harness.rel_diff(eager["params"], control["params"])
    if name == "syncbn" and _cpu(info):
        # The statistics of every rank are used: BatchNorm of each rank's own normalises
        # the first batch differently already, so one step of it says so.
        plain = _run(
            info,
            workload,
            batches[:1],
            captured=False,
            ddp_kw=ddp_kw,
            context=context,
            convert=False,
        )
        result["batch_norm_loss_diff"] = abs(plain["losses"][0] - graphed["losses"][0])
    return {
        **result,
        **{k: graphed[k] for k in ("state", "code", "reason", "stats", "collectives")},
        "steps": len(batches),
        "same_losses": graphed["losses"] == eager["losses"],
        "losses_finite": all(math.isfinite(v) for v in graphed["losses"]),
        "param_rel_diff": harness.rel_diff(eager["params"], graphed["params"]),
        "buffer_rel_diff": harness.rel_diff(eager["buffers"], graphed["buffers"]),
    }


NAMES = [
    "bert",
    "bert_as_called",
    "moe",
    "moe_bf16",
    "moe_eager_experts",
    "syncbn",
    "ckpt",
    "ckpt_reentrant",
]
REGISTRY: dict[str, harness.Scenario] = {n: (lambda info, n=n: compare(info, n)) for n in NAMES}

if __name__ == "__main__":
    harness.run(REGISTRY)
