"""Strategies across processes: torchrun + gloo on CPU, stand-in graph backend and
grapher, stand-in candidates with scripted timings. Each rank reports what it chose
and how its training compares with the same training done eagerly.
"""

from __future__ import annotations

import warnings
from typing import Any

import harness
import torch
import torch.nn.functional as F
from torch import nn

import ddpgraph
from ddpgraph import CaptureOptions
from ddpgraph.ddp.distributed import DistInfo
from ddpgraph.strategies import (
    AutoStep,
    Candidate,
    EagerStep,
    TrialSettings,
    make_step,
    partial,
)
from ddpgraph.strategies.evaluation import capture_eval
from ddpgraph.strategies.partial import partial_report

FAST = TrialSettings(check_steps=2, timing_steps=4, timing_windows=2, min_setup_calls=1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4))


def _batches(info: DistInfo, n: int, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + info.rank)
    return [
        (torch.randn(size, 16, generator=gen), torch.randint(0, 4, (size,), generator=gen))
        for _ in range(n)
    ]


class _Setup:
    def __init__(self, graph_safe: bool = False) -> None:
        self.ddp = ddpgraph.prepare_ddp(_model())
        self.opt = torch.optim.AdamW(
            self.ddp.parameters(), **harness.optimizer_kwargs(torch.optim.AdamW), lr=1e-2
        )
        if graph_safe:
            ddpgraph.graph_safe_optimizer(self.opt, tensor_lr_on_cpu=True)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.ddp(x), y)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def train(self, call: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        return [float(call(x, y)) for x, y in batches]


def _reference(
    batches: list[tuple[torch.Tensor, torch.Tensor]], graph_safe: bool
) -> tuple[list[float], list[torch.Tensor]]:
    ref = _Setup(graph_safe)
    losses = ref.train(ref.step, batches)
    return losses, harness.params_of(ref.ddp)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Scripted:
    """A real step taking `ms` per call on the fake clock; `after` runs after each call."""

    def __init__(self, inner: Any, clock: Clock, ms: float, after: Any = None) -> None:
        self.inner, self.clock, self.ms, self.after = inner, clock, ms, after

    state = property(lambda self: self.inner.state)
    reason = property(lambda self: self.inner.reason)
    stats = property(lambda self: self.inner.stats)

    def __call__(self, *args: Any) -> Any:
        out = self.inner(*args)
        self.clock.now += self.ms / 1000
        if self.after is not None:
            self.after()
        return out

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> Scripted:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def auto_agreement(info: DistInfo) -> dict[str, Any]:
    """Ranks measure differently and one rank alone sees a mismatch or a failed capture:
    all ranks still reach the same verdicts and the same winner, and training after
    the selection equals eager training."""
    batches = _batches(info, 16)
    ref_losses, ref_params = _reference(batches, graph_safe=True)
    run = _Setup(graph_safe=True)
    clock = Clock()
    last = info.world_size - 1

    def nudge() -> None:
        if info.rank == last:
            with torch.no_grad():
                for p in run.ddp.parameters():
                    p.add_(1e-3)

    def eager(ms: float, after: Any = None) -> Scripted:
        return Scripted(
            EagerStep(run.step, model=run.ddp, options=CaptureOptions()), clock, ms, after
        )

    def whole(fail: set[int], ms: float) -> Scripted:
        backend = harness.backend(fail_ranks=fail)
        return Scripted(
            ddpgraph.capture_step(run.step, model=run.ddp, optimizer=run.opt, backend=backend),
            clock,
            ms,
        )

    candidates = [
        Candidate("eager", lambda: eager(10.0)),
        Candidate("whole", lambda: whole(set(), 3.0 if info.rank == 0 else 6.0)),
        Candidate("partial", lambda: eager(1.0, nudge)),
        Candidate("compile", lambda: whole({last}, 1.0), exact=False),
    ]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        step = AutoStep(
            run.step,
            model=run.ddp,
            optimizers=[run.opt],
            candidates=candidates,
            settings=FAST,
            clock=clock,
        )
        losses = run.train(step, batches)
    report = step.reason
    assert report is not None
    step.close()
    return {
        "report": report.as_dict(),
        "loss_rel_diff": harness.loss_rel_diff(ref_losses, losses),
        "param_rel_diff": harness.rel_diff(ref_params, harness.params_of(run.ddp)),
    }


def auto_budget(info: DistInfo) -> dict[str, Any]:
    """The last rank's clock says the budget is spent, the others' do not: every rank
    skips the remaining candidates together."""
    run = _Setup(graph_safe=True)
    clock = Clock()
    ms = 1000.0 if info.rank == info.world_size - 1 else 1.0

    def eager() -> Scripted:
        return Scripted(EagerStep(run.step, model=run.ddp, options=CaptureOptions()), clock, ms)

    def whole() -> Scripted:
        step = ddpgraph.capture_step(
            run.step, model=run.ddp, optimizer=run.opt, backend=harness.backend()
        )
        return Scripted(step, clock, 0.5)

    candidates = [Candidate("eager", eager), Candidate("whole", whole)]
    step = AutoStep(
        run.step,
        model=run.ddp,
        optimizers=[run.opt],
        candidates=candidates,
        settings=FAST,
        clock=clock,
        budget_s=5.0,
    )
    run.train(step, _batches(info, 2))
    report = step.reason
    assert report is not None
    step.close()
    return {"report": report.as_dict()}


def partial_agreement(info: DistInfo) -> dict[str, Any]:
    """The whole model fails to graph on the last rank only: no rank graphs it, every
    rank graphs its children instead, and training equals eager."""
    batches = _batches(info, 12)
    ref_losses, ref_params = _reference(batches, graph_safe=False)
    run = _Setup()
    root = run.ddp.module

    def grapher(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if module is root and info.rank == info.world_size - 1:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        original = module.forward
        module.forward = lambda *a: original(*a)  # type: ignore[method-assign]

    # The stand-in records submodules in place of CUDA graphs; the step reads it once built.
    monkeypatch_grapher(grapher)
    try:
        step = make_step(run.step, model=run.ddp, optimizer=run.opt, strategy="partial")
    finally:
        monkeypatch_grapher(None)
    losses = run.train(step, batches)
    report = partial_report(run.ddp)
    assert report is not None
    result = {
        "state": step.state.value,
        "graphed": report.graphed,
        "skipped": {
            s.name: (
                s.finding.code.value if s.finding else None,
                list(s.finding.ranks) if s.finding else [],
            )
            for s in report.skipped
        },
        "loss_rel_diff": harness.loss_rel_diff(ref_losses, losses),
        "param_rel_diff": harness.rel_diff(ref_params, harness.params_of(run.ddp)),
    }
    step.close()
    return result


def eval_between_steps(info: DistInfo) -> dict[str, Any]:
    """A captured evaluation (its capture failing on the last rank only for the second
    model) between captured training steps: every rank takes the same path, buffers
    are synced as eager DDP syncs them, and training and predictions equal eager."""
    batches = _batches(info, 16)
    probe_x = _batches(info, 1)[0][0]

    def train(
        capture: bool, fail: set[int]
    ) -> tuple[list[float], list[torch.Tensor], list[torch.Tensor], dict[str, Any]]:
        run = _Setup(graph_safe=True)
        summary: dict[str, Any] = {}
        if capture:
            step: Any = ddpgraph.capture_step(
                run.step, model=run.ddp, optimizer=run.opt, backend=harness.backend()
            )
            evaluate: Any = capture_eval(
                lambda x: run.ddp(x).softmax(-1),
                model=run.ddp,
                backend=harness.backend(fail_ranks=fail),
            )
        else:
            step = run.step

            def evaluate(x: torch.Tensor) -> torch.Tensor:
                run.ddp.eval()
                with torch.no_grad():
                    out = run.ddp(x).softmax(-1)
                run.ddp.train()
                return out

        losses, preds = [], []
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            for i, (x, y) in enumerate(batches):
                losses.append(float(step(x, y)))
                if i % 2 == 1:
                    preds.append(evaluate(probe_x).clone())
        if capture:
            summary = {
                "train": step.state.value,
                "eval": evaluate.state.value,
                "code": evaluate.reason.code.value if evaluate.reason else None,
            }
            step.close()
            evaluate.close()
        return losses, preds, list(run.ddp.buffers()), summary

    ref_losses, ref_preds, ref_buffers, _ = train(False, set())
    out = {}
    for name, fail in (("captured", set()), ("failing", {info.world_size - 1})):
        losses, preds, buffers, summary = train(True, fail)
        out[name] = {
            **summary,
            "loss_rel_diff": harness.loss_rel_diff(ref_losses, losses),
            "pred_rel_diff": harness.rel_diff(ref_preds, preds),
            "buffer_rel_diff": harness.rel_diff(ref_buffers, buffers),
        }
    return out


def monkeypatch_grapher(grapher: Any) -> None:
    """Install `grapher` in place of CUDA graphs of submodules (None: CUDA graphs again)."""
    partial._STAND_IN_GRAPHER = grapher


def strategies_equal_eager(info: DistInfo) -> dict[str, Any]:
    """Each strategy that runs on CPU (whole and compile with the stand-in backend,
    partial with the stand-in grapher) trains like eager with the same optimizer."""
    batches = _batches(info, 14)
    refs = {safe: _reference(batches, graph_safe=safe) for safe in (False, True)}
    out: dict[str, Any] = {}
    for name, kw, safe in (
        ("eager", {}, False),
        ("whole", {"backend": harness.backend()}, True),
        ("compile", {"backend": harness.backend(), "compile_backend": "eager"}, True),
        ("partial", {}, False),
    ):
        torch._dynamo.reset()
        run = _Setup()
        monkeypatch_grapher((lambda m, a: None) if name == "partial" else None)
        try:
            step = make_step(run.step, model=run.ddp, optimizer=run.opt, strategy=name, **kw)  # type: ignore[arg-type]
        finally:
            monkeypatch_grapher(None)
        losses = run.train(step, batches)
        ref_losses, ref_params = refs[safe]
        out[name] = {
            "state": step.state.value,
            "loss_rel_diff": harness.loss_rel_diff(ref_losses, losses),
            "param_rel_diff": harness.rel_diff(ref_params, harness.params_of(run.ddp)),
        }
        step.close()
    return {"strategies": out}


REGISTRY = {
    "auto_agreement": auto_agreement,
    "auto_budget": auto_budget,
    "partial_agreement": partial_agreement,
    "eval_between_steps": eval_between_steps,
    "strategies_equal_eager": strategies_equal_eager,
}

if __name__ == "__main__":
    harness.run(REGISTRY)
