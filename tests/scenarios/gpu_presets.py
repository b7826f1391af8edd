"""Bench presets and `capture_step(compile=True)` on real GPUs with NCCL.

Each preset is built from its library's configuration, wrapped by `prepare_ddp` and
trained by `capture_step` for its warm-up, the capture and 3 replays, at batch 2 with
bf16 autocast; `fused_adamw` does the same for TinyGPT with a fused AdamW. Then a small
TinyGPT is trained by `capture_step(..., compile=True)` (inductor, the whole step
captured around it) against the same compiled model run eagerly.

Run by tests/gpu/test_presets_gpu.py under torchrun with one process per GPU.
"""

from __future__ import annotations

import logging
import math
from typing import Any
from unittest import mock

import harness
import torch

import ddpgraph
from ddpgraph.app.models import GPTConfig, Workload, gpt_workload
from ddpgraph.app.reference_step import StepOptions, make_train_step
from ddpgraph.bench.presets import PRESETS
from ddpgraph.bench.workloads import resolve_model
from ddpgraph.ddp.distributed import DistInfo
from ddpgraph.errors import DdpGraphUsageError
from ddpgraph.step.step_settings import StepSettings

BATCH = 2
REPLAYS = 3
BF16 = StepOptions(amp_dtype=torch.bfloat16, clip_norm=None)
SMALL_GPT = GPTConfig(vocab=512, block=64, layers=2, dim=128, heads=4)


def _batches(workload: Workload, info: DistInfo, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11 + info.rank)
    return [workload.make_batch(BATCH, gen, info.device) for _ in range(n)]


def _sync(info: DistInfo) -> None:
    if info.device.type == "cuda":
        torch.cuda.synchronize()


def _device_ids(info: DistInfo) -> dict[str, Any]:
    return {"device_ids": [info.device.index]} if info.device.type == "cuda" else {}


def _captured_run(workload: Workload, info: DistInfo, settings: StepSettings) -> dict[str, Any]:
    torch.manual_seed(0)
    ddp = ddpgraph.prepare_ddp(workload.build().to(info.device), **_device_ids(info))
    opt = settings.adamw(ddp.parameters(), lr=1e-4)
    before = harness.params_of(ddp)
    step = ddpgraph.capture_step(
        make_train_step(ddp, opt, workload.loss, BF16), model=ddp, optimizer=opt
    )
    losses = []
    used = _batches(workload, info, 4)
    with step:
        for x, y in used:
            losses.append(float(step(x, y)))
        while step.stats.replays < REPLAYS and step.stats.calls < 40:
            used.append(_batches(workload, info, 1)[0])
            losses.append(float(step(*used[-1])))
        _sync(info)
        result = {
            "state": step.state.value,
            "reason": step.reason.format() if step.reason else None,
            "stats": vars(step.stats),
            "losses_finite": all(math.isfinite(v) for v in losses),
            "params_moved": harness.rel_diff(before, harness.params_of(ddp)) > 0,
        }
    # Parity: the same batches run eagerly (DDP on the default stream, the same graph-safe
    # optimizer), twice: the second run is the control, how far eager is from itself.
    reference = _eager_params(workload, info, settings, used)
    captured = harness.params_of(ddp)
    result["param_rel_diff"] = harness.rel_diff(reference, captured)
    result["control_rel_diff"] = harness.rel_diff(
        reference, _eager_params(workload, info, settings, used)
    )
    # transformers cannot read a tensor's values while a graph is recorded, so there it
    # takes the branch that does not need them (an explicit causal mask where, in eager,
    # it reads the position ids, finds no packed sequences and lets SDPA use `is_causal`):
    # another attention kernel. Eager told the same from the recorded step on (the
    # warm-up steps were eager ones) reproduces the graph's arithmetic; that branch's own
    # control says how far it is from itself.
    recorded_from = step.stats.warmup_steps
    on_branch = _eager_params(workload, info, settings, used, recorded_from=recorded_from)
    result["library_path_rel_diff"] = harness.rel_diff(on_branch, captured)
    result["library_path_control_rel_diff"] = harness.rel_diff(
        on_branch, _eager_params(workload, info, settings, used, recorded_from=recorded_from)
    )
    return result


def _eager_params(
    workload: Workload,
    info: DistInfo,
    settings: StepSettings,
    batches: list[Any],
    *,
    recorded_from: int | None = None,
) -> list[torch.Tensor]:
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(
        workload.build().to(info.device), **_device_ids(info)
    )
    opt = settings.adamw(ddp.parameters(), lr=1e-4)
    step = harness.with_same_settings(
        opt, make_train_step(ddp, opt, workload.loss, BF16), info.device
    )
    as_recorded = recorded_from is not None and _has_transformers_masks()
    for i, (x, y) in enumerate(batches):
        if as_recorded and i >= recorded_from:
            with mock.patch("transformers.masking_utils.is_tracing", return_value=True):
                step(x, y)
        else:
            step(x, y)
    _sync(info)
    return harness.params_of(ddp)


def _has_transformers_masks() -> bool:
    try:
        import transformers.masking_utils as masks
    except ImportError:
        return False
    return hasattr(masks, "is_tracing")


def _preset(name: str) -> Any:
    def scenario(info: DistInfo) -> dict[str, Any]:
        try:
            workload = resolve_model(name).workload
        except DdpGraphUsageError as err:  # the library is not installed here
            return {"skipped": str(err)}
        return _captured_run(workload, info, StepSettings())

    return scenario


def fused_adamw(info: DistInfo) -> dict[str, Any]:
    return _captured_run(gpt_workload(SMALL_GPT), info, StepSettings(adam_kernel="fused"))


def compile_switch(info: DistInfo) -> dict[str, Any]:
    """capture_step(compile=True) against the same model compiled in place, run eagerly
    with the same graph-safe optimizer (compiled kernels are the same in both)."""
    workload = gpt_workload(SMALL_GPT)
    data = _batches(workload, info, 20)

    def run(switch: bool) -> tuple[list[float], list[torch.Tensor], dict[str, Any]]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        ddp = ddpgraph.prepare_ddp(workload.build().to(info.device), **_device_ids(info))
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        fn = make_train_step(ddp, opt, workload.loss, BF16)
        if switch:
            step: Any = ddpgraph.capture_step(fn, model=ddp, optimizer=opt, compile=True)
        else:
            ddpgraph.graph_safe_optimizer(opt)
            ddp.compile()
            step = fn
        losses = [float(step(x, y)) for x, y in data]
        _sync(info)
        summary: dict[str, Any] = {}
        if switch:
            summary = {
                "state": step.state.value,
                "stats": vars(step.stats),
                "restarts": step.restarts,
                "strategy": step.strategy,
                "reason": step.reason.format() if step.reason else None,
            }
            step.close()
            summary["compiled_after_close"] = ddp._compiled_call_impl is not None
        return losses, harness.params_of(ddp), summary

    ref_losses, ref_params, _ = run(False)
    losses, params, summary = run(True)
    torch._dynamo.reset()
    return {
        **summary,
        "loss_rel_diff": harness.loss_rel_diff(ref_losses, losses),
        "param_rel_diff": harness.rel_diff(ref_params, params),
    }


class _Warnings(logging.Handler):
    """The ddpgraph logger's warnings during a run (the capture-branch report)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _parity_run(name: str, info: DistInfo, parity: Any) -> dict[str, Any]:
    """`capture_step(..., parity=...)` on a preset as a user would turn it on, with the
    ddpgraph logger's warnings collected."""
    try:
        workload = resolve_model(name).workload
    except DdpGraphUsageError as err:
        return {"skipped": str(err)}
    torch.manual_seed(0)
    ddp = ddpgraph.prepare_ddp(workload.build().to(info.device), **_device_ids(info))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    handler = _Warnings()
    logging.getLogger("ddpgraph").addHandler(handler)
    try:
        step = ddpgraph.capture_step(
            make_train_step(ddp, opt, workload.loss, BF16), model=ddp, optimizer=opt, parity=parity
        )
        with step:
            # Through the warm-up and the capture, to 3 replays or 2 eager steps after it.
            while (
                step.stats.calls < 30
                and step.stats.replays < REPLAYS
                and step.stats.eager_steps < 2
            ):
                step(*_batches(workload, info, 1)[0])
            _sync(info)
            return {
                "state": step.state.value,
                "reason": step.reason.format() if step.reason else None,
                "stats": vars(step.stats),
                "warnings": handler.messages,
            }
    finally:
        logging.getLogger("ddpgraph").removeHandler(handler)


def parity_llama_exact(info: DistInfo) -> dict[str, Any]:
    return _parity_run("hf-llama", info, True)


def parity_llama_tolerant(info: DistInfo) -> dict[str, Any]:
    return _parity_run("hf-llama", info, ddpgraph.ParityCheck(rtol=1e-2))


def parity_gpt2_exact(info: DistInfo) -> dict[str, Any]:
    return _parity_run("hf-gpt2", info, True)


REGISTRY = {
    "parity_llama_exact": parity_llama_exact,
    "parity_llama_tolerant": parity_llama_tolerant,
    "parity_gpt2_exact": parity_gpt2_exact,
    **{f"preset_{name.replace('-', '_')}": _preset(name) for name in PRESETS},
    "fused_adamw": fused_adamw,
    "compile_switch": compile_switch,
}

if __name__ == "__main__":
    harness.run(REGISTRY)
