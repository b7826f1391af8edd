"""The strategies of `make_step` on real GPUs with NCCL, each against the same training
run eagerly; `auto` on a launch-bound model and on a step with a host sync; a captured
evaluation between captured training steps; and the ms/step table of docs/strategies.md.

Run by tests/gpu/test_strategies_gpu.py under torchrun with one process per GPU. Models
that get compiled are small (TinyGPT, a ResNet-style CNN, a small MLP), and the same
model configurations recur, so inductor's cache serves the later compiles.
"""

from __future__ import annotations

import gc
import inspect
import math
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import harness
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpgraph
from ddpgraph.app.models import (
    GPTConfig,
    SmallResNet,
    TinyGPT,
    Workload,
    cnn_workload,
    cosine_with_warmup,
    gpt_workload,
)
from ddpgraph.app.reference_step import StepOptions, make_train_step
from ddpgraph.ddp.build import forward_counter
from ddpgraph.ddp.distributed import DistInfo
from ddpgraph.strategies import make_step
from ddpgraph.strategies.dynamo import compile_count
from ddpgraph.strategies.evaluation import capture_eval
from ddpgraph.strategies.partial import graph_submodules, partial_report

BF16 = StepOptions(amp_dtype=torch.bfloat16, clip_norm=1.0)
SMALL_GPT = GPTConfig(vocab=512, block=64, layers=2, dim=128, heads=4)
Batch = tuple[torch.Tensor, torch.Tensor]


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _build(workload: Workload, info: DistInfo) -> nn.Module:
    torch.manual_seed(0)  # the same weights for every run and rank
    return workload.build().to(info.device)


def _batches(workload: Workload, info: DistInfo, n: int, size: int, seed: int = 11) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed + info.rank)
    return [workload.make_batch(size, gen, info.device) for _ in range(n)]


def _train(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batches: list[Batch],
    sched: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> list[float]:
    losses = []
    for x, y in batches:
        losses.append(float(step(x, y)))  # read now: a replay overwrites it
        if sched is not None:
            sched.step()
    return losses


def _eager_reference(
    workload: Workload, info: DistInfo, batches: list[Batch], *, graph_safe: bool
) -> tuple[list[float], list[torch.Tensor]]:
    """Plain DDP on the default stream: what the strategy under test must reproduce."""
    ddp = DDP(_build(workload, info), device_ids=[info.device.index])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)
    if graph_safe:
        ddpgraph.graph_safe_optimizer(opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(len(batches)))
    losses = _train(make_train_step(ddp, opt, workload.loss, BF16), batches, sched)
    params = harness.params_of(ddp)
    del ddp, opt
    _free()
    return losses, params


def _strategy_run(
    workload: Workload, info: DistInfo, batches: list[Batch], strategy: str, **kw: Any
) -> tuple[list[float], list[torch.Tensor], Any, DDP]:
    ddp = ddpgraph.prepare_ddp(_build(workload, info), device_ids=[info.device.index])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)
    step = make_step(
        make_train_step(ddp, opt, workload.loss, BF16),
        model=ddp,
        optimizer=opt,
        strategy=strategy,  # type: ignore[arg-type]
        **kw,
    )
    # After make_step, as in the reference: a scheduler made before the learning rate
    # became a tensor computes it in float64, after in float32 (one ulp apart), and
    # bf16 training amplifies that.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(len(batches)))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        losses = _train(step, batches, sched)
    return losses, harness.params_of(ddp), step, ddp


def _summary(step: Any) -> dict[str, Any]:
    reason = step.reason
    return {
        "state": step.state.value,
        "code": reason.code.value if reason is not None else None,
        "reason": reason.format() if reason is not None else None,
        "stats": vars(step.stats),
    }


def _diffs(
    ref: tuple[list[float], list[torch.Tensor]], losses: list[float], params: list[torch.Tensor]
) -> dict[str, Any]:
    return {
        "loss_rel_diff": harness.loss_rel_diff(ref[0], losses),
        "param_rel_diff": harness.rel_diff(ref[1], params),
        "bitwise_equal": all(torch.equal(a, b) for a, b in zip(ref[1], params, strict=True)),
    }


# ------------------------------------------------------------------ partial capture
class CheckedGPT(TinyGPT):
    """A GPT whose forward checks the activations on the host between blocks: control
    flow on a tensor value, which no whole-step graph can hold."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
            if not torch.isfinite(x).all():  # the host sync between modules
                raise FloatingPointError("activations are not finite")
        return self.head(self.ln(x))


CHECK_LINE = inspect.getsourcelines(CheckedGPT.forward)[1] + 5


def partial_host_sync(info: DistInfo) -> dict[str, Any]:
    """A model with a host sync between its blocks: strategy "partial" graphs every
    submodule it can (all but the model itself), trains like eager, and runs an odd
    batch through the original forwards."""
    base = gpt_workload(SMALL_GPT)
    workload = Workload("checked-gpt", lambda: CheckedGPT(SMALL_GPT), base.make_batch, base.loss)
    batches = _batches(workload, info, 24, 8)
    batches[17] = _batches(workload, info, 1, 4, seed=99)[0]  # an odd batch, on every rank
    ref = _eager_reference(workload, info, batches, graph_safe=False)
    losses, params, step, ddp = _strategy_run(workload, info, batches, "partial")
    report = partial_report(ddp)
    assert report is not None
    skipped = {s.name: s for s in report.skipped}
    root = skipped.get("")
    result = {
        **_summary(step),
        **_diffs(ref, losses, params),
        "graphed": report.graphed,
        "root_code": root.finding.code.value if root and root.finding else None,
        "root_line": root.finding.location.lineno
        if root and root.finding and root.finding.location
        else None,
        "expected_line": CHECK_LINE,
        "replays": report.replays,
        "fallbacks": report.fallbacks,
        "report": report.format(),
    }
    step.close()
    return result


def graph_submodules_before_ddp(info: DistInfo) -> dict[str, Any]:
    """`graph_submodules` on the bare model, then DDP (plain DDP: the step is not captured
    whole, and runs on the default stream): the whole model's forward and backward are
    graphs, DDP's all-reduce runs from its hooks after them."""
    workload = gpt_workload(SMALL_GPT)
    batches = _batches(workload, info, 20, 8)
    ref = _eager_reference(workload, info, batches, graph_safe=False)
    model = graph_submodules(_build(workload, info), (batches[0][0],), amp_dtype=torch.bfloat16)
    ddp = DDP(model, device_ids=[info.device.index])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(len(batches)))
    losses = _train(make_train_step(ddp, opt, workload.loss, BF16), batches, sched)
    report = partial_report(model)
    assert report is not None
    ddp.eval()
    with torch.no_grad():
        ddp(batches[0][0])  # eval mode: the original forward
    return {
        **_diffs(ref, losses, harness.params_of(ddp)),
        "graphed": report.graphed,
        "replays": report.replays,
    }


# ------------------------------------------------------------------ compile
def compile_equivalence(info: DistInfo) -> dict[str, Any]:
    """The demo GPT compiled by inductor (default mode) inside the whole-step graph:
    captured after the usual warm-up, nothing compiled during or after the capture, and
    training like eager within the rounding of fused kernels."""
    workload = gpt_workload(GPTConfig())
    batches = _batches(workload, info, 30, 8)
    plain = _eager_reference(workload, info, batches, graph_safe=True)
    before = compile_count()
    ddp = ddpgraph.prepare_ddp(_build(workload, info), device_ids=[info.device.index])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)
    step = make_step(
        make_train_step(ddp, opt, workload.loss, BF16), model=ddp, optimizer=opt, strategy="compile"
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(len(batches)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _train(step, batches[:13], sched)
        at_capture = compile_count()
        losses += _train(step, batches[13:], sched)
    params = harness.params_of(ddp)
    counter = forward_counter(ddp)
    result = {
        **_summary(step),
        "restarts": getattr(step, "restarts", None),
        "compiled_frames": at_capture - before,
        "compiled_after_capture": compile_count() - at_capture,
        "forwards": counter.count if counter else None,
        "vs_plain": _diffs(plain, losses, params),
        "first_losses": losses[:3],
        "last_losses": losses[-3:],
        "warnings": [
            str(w.message)[:300] for w in caught if issubclass(w.category, ddpgraph.DdpGraphWarning)
        ],
    }
    step.close()
    return result


def reduce_overhead(info: DistInfo) -> dict[str, Any]:
    """torch.compile's own CUDA graphs (mode "reduce-overhead"), for comparison: it
    trains like eager within rounding; ddpgraph records nothing."""
    workload = gpt_workload(GPTConfig())
    batches = _batches(workload, info, 30, 8)
    plain = _eager_reference(workload, info, batches, graph_safe=False)
    losses, params, step, _ = _strategy_run(workload, info, batches, "reduce-overhead")
    result = {
        **_summary(step),
        **_diffs(plain, losses, params),
        "description": getattr(step, "description", ""),
    }
    step.close()
    return result


# ------------------------------------------------------------------ evaluation
def eval_between_steps(info: DistInfo) -> dict[str, Any]:
    """A ResNet-style CNN (batch norm, buffers synced by DDP) trained by a captured step,
    evaluated every other step by a captured evaluation in the same memory pool:
    predictions, parameters and batch-norm statistics equal the eager run's."""
    workload = Workload(
        "cnn",
        lambda: SmallResNet(classes=10, width=16),
        cnn_workload(32, 10).make_batch,
        cnn_workload(32, 10).loss,
    )
    options = StepOptions(amp_dtype=None, clip_norm=1.0)
    batches = _batches(workload, info, 24, 16)
    probe = _batches(workload, info, 1, 16, seed=77)[0][0]

    def run(captured: bool) -> dict[str, Any]:
        torch.manual_seed(0)
        model = workload.build().to(info.device)
        ddp = (
            ddpgraph.prepare_ddp(model, device_ids=[info.device.index])
            if captured
            else DDP(model, device_ids=[info.device.index])
        )
        opt = ddpgraph.graph_safe_optimizer(
            torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        )
        fn = make_train_step(ddp, opt, workload.loss, options)
        out: dict[str, Any] = {"preds": [], "forward_deltas": []}
        if captured:
            pool = torch.cuda.graph_pool_handle()
            step: Any = ddpgraph.capture_step(fn, model=ddp, optimizer=opt, pool=pool)
            evaluate: Any = capture_eval(
                lambda x: ddp(x).softmax(-1), model=ddp, training_step=step, pool=pool
            )
        else:
            step = fn

            def evaluate(x: torch.Tensor) -> torch.Tensor:
                ddp.eval()
                with torch.no_grad():
                    y = ddp(x).softmax(-1)
                ddp.train()
                return y

        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            losses = []
            for i, (x, y) in enumerate(batches):
                losses.append(float(step(x, y)))
                if i % 2 == 1:
                    counter = forward_counter(ddp)
                    before = counter.count if counter else 0
                    out["preds"].append(evaluate(probe).clone())
                    out["forward_deltas"].append((counter.count if counter else 0) - before)
        out["losses"] = losses
        out["params"] = harness.params_of(ddp)
        out["buffers"] = [b.detach().clone() for b in ddp.buffers()]
        if captured:
            out["train"] = _summary(step)
            out["eval"] = {**_summary(evaluate), "pool_shared": evaluate.pool_shared}
            evaluate.close()
            step.close()
        return out

    # Convolution backward may use atomics, which differ run to run: fixed algorithms, so
    # the comparison sees capture effects only.
    deterministic = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        ref = run(False)
        _free()
        got = run(True)
    finally:
        torch.backends.cudnn.deterministic = deterministic
    return {
        "train": got["train"],
        "eval": got["eval"],
        "forward_deltas": got["forward_deltas"],
        "loss_rel_diff": harness.loss_rel_diff(ref["losses"], got["losses"]),
        "param_rel_diff": harness.rel_diff(ref["params"], got["params"]),
        "buffer_rel_diff": harness.rel_diff(ref["buffers"], got["buffers"]),
        "pred_rel_diff": harness.rel_diff(ref["preds"], got["preds"]),
    }


# ------------------------------------------------------------------ auto
def auto_launch_bound(info: DistInfo) -> dict[str, Any]:
    """A small GPT at batch 8 is launch-bound: auto must choose the whole-step graph, and
    training from the first call equals eager training with the graph-safe optimizer."""
    workload = gpt_workload(SMALL_GPT)
    batches = _batches(workload, info, 30, 8)
    ref = _eager_reference(workload, info, batches, graph_safe=True)
    losses, params, step, _ = _strategy_run(
        workload, info, batches, "auto", candidates=["eager", "whole", "partial"], budget_s=90.0
    )
    return _auto_result(step, _diffs(ref, losses, params))


def auto_host_sync(info: DistInfo) -> dict[str, Any]:
    """A step that reads its loss on the host (`loss.item()`): the whole-step graph and
    the compiled one are refused by the warm-up probe, auto falls back to partial or
    eager, and training equals eager training."""
    workload = gpt_workload(SMALL_GPT)
    batches = _batches(workload, info, 24, 8)
    logged: list[float] = []

    def make(
        ddp: nn.Module, opt: torch.optim.Optimizer
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        inner = make_train_step(ddp, opt, workload.loss, BF16)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = inner(x, y)
            logged.append(loss.item())  # the host sync
            return loss

        return step

    ref_ddp = DDP(_build(workload, info), device_ids=[info.device.index])
    ref_opt = ddpgraph.graph_safe_optimizer(
        torch.optim.AdamW(ref_ddp.parameters(), lr=1e-3, weight_decay=0.01)
    )
    ref_losses = _train(make(ref_ddp, ref_opt), batches)
    ref_params = harness.params_of(ref_ddp)
    del ref_ddp, ref_opt
    _free()
    ddp = ddpgraph.prepare_ddp(_build(workload, info), device_ids=[info.device.index])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)
    step = make_step(make(ddp, opt), model=ddp, optimizer=opt, strategy="auto", budget_s=150.0)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        losses = _train(step, batches)
    return _auto_result(step, _diffs((ref_losses, ref_params), losses, harness.params_of(ddp)))


def _auto_result(step: Any, diffs: dict[str, Any]) -> dict[str, Any]:
    report, state = step.reason, step.state.value
    assert report is not None
    step.close()
    return {**diffs, "state": state, "report": report.as_dict(), "text": report.format()}


# ------------------------------------------------------------------ the table
TABLE_STRATEGIES = ("eager", "whole", "partial", "compile", "reduce-overhead")
TIMED_STEPS, WINDOWS = 40, 4


def _time_strategy(workload: Workload, info: DistInfo, batch: int, strategy: str) -> dict[str, Any]:
    batches = _batches(workload, info, 8, batch, seed=5)
    ddp = ddpgraph.prepare_ddp(_build(workload, info), device_ids=[info.device.index])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    step = make_step(
        make_train_step(ddp, opt, workload.loss, BF16),
        model=ddp,
        optimizer=opt,
        strategy=strategy,  # type: ignore[arg-type]
    )
    started = time.perf_counter()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for i in range(16):  # warm-up, capture, compile: not timed
            step(*batches[i % len(batches)])
        setup_s = time.perf_counter() - started
        windows = []
        per = TIMED_STEPS // WINDOWS
        for w in range(WINDOWS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(per):
                step(*batches[(w * per + i) % len(batches)])
            torch.cuda.synchronize()
            windows.append((time.perf_counter() - t0) * 1000 / per)
    summary = _summary(step)
    step.close()
    del step, ddp, opt
    if strategy in ("compile", "reduce-overhead"):
        torch._dynamo.reset()  # frees CUDA graph trees; the on-disk compile cache stays
    _free()
    return {
        "ms": statistics.median(windows),
        "spread": max(windows) - min(windows),
        "setup_s": setup_s,
        **summary,
    }


def strategy_table(info: DistInfo) -> dict[str, Any]:
    """ms/step of each strategy on the demo GPT (batch 8) and a ResNet-style CNN (batch
    32 at 64x64), with bf16 autocast, clipping and AdamW; a Markdown table to paste."""
    workloads = [
        ("TinyGPT, batch 8", gpt_workload(GPTConfig()), 8),
        ("ResNet-style CNN, batch 32", cnn_workload(64, 100), 32),
    ]
    rows: dict[str, dict[str, Any]] = {}
    for label, workload, batch in workloads:
        for strategy in TABLE_STRATEGIES:
            try:
                rows.setdefault(strategy, {})[label] = _time_strategy(
                    workload, info, batch, strategy
                )
            except Exception as exc:  # one strategy failing must not hide the others
                rows.setdefault(strategy, {})[label] = {
                    "error": f"{type(exc).__name__}: {exc}"[:500]
                }
    # Every rank times; the slowest rank is what training sees.
    gathered: list[Any] = [None] * info.world_size
    torch.distributed.all_gather_object(gathered, rows)
    slowest = {
        s: {
            label: max((g[s][label] for g in gathered), key=lambda r: r.get("ms", math.inf))
            for label in rows[s]
        }
        for s in rows
    }
    return {"rows": slowest, "markdown": _markdown(slowest, [w[0] for w in workloads], info)}


def _markdown(rows: dict[str, dict[str, Any]], labels: list[str], info: DistInfo) -> str:
    head = "| strategy | " + " | ".join(f"{label}: ms/step | vs eager" for label in labels) + " |"
    lines = [
        f"ms per training step, median of {WINDOWS} windows of {TIMED_STEPS // WINDOWS} steps, "
        f"slowest of {info.world_size} ranks, {torch.cuda.get_device_name(info.device)}, "
        f"torch {torch.__version__}:",
        "",
        head,
        "| --- |" + " ---: | ---: |" * len(labels),
    ]
    for strategy, cells in rows.items():
        parts = []
        for label in labels:
            cell, eager = cells.get(label, {}), rows.get("eager", {}).get(label, {})
            if "ms" not in cell:
                parts += ["failed", "-"]
                continue
            state = "" if cell["state"] in ("captured", "eager") else f" ({cell['state']})"
            speedup = f"{eager['ms'] / cell['ms']:.2f}x" if "ms" in eager else "-"
            parts += [f"{cell['ms']:.2f}{state}", speedup]
        lines.append(f"| {strategy} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


REGISTRY = {
    "partial_host_sync": partial_host_sync,
    "graph_submodules_before_ddp": graph_submodules_before_ddp,
    "eval_between_steps": eval_between_steps,
    "auto_launch_bound": auto_launch_bound,
    "compile_equivalence": compile_equivalence,
    "reduce_overhead": reduce_overhead,
    "auto_host_sync": auto_host_sync,
    "strategy_table": strategy_table,
}

if __name__ == "__main__":
    harness.run(REGISTRY)
