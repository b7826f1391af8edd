"""Every hyper-parameter a schedule changes stays live in the graph, on one GPU (world size
1, no process group needed).

* ddpgraph's own updates against PyTorch's CUDA kernels at the same values, bit for bit:
  Adam and AdamW against the capturable foreach kernel (`capturable=True`, tensor lr),
  SGD against the foreach kernel, each with the value fixed and changed every step,
  over weight decay, amsgrad, maximize, nesterov and dampening. (The SGD update's
  difference from the fused kernel, which it replaces when a schedule cycles momentum,
  is printed, not asserted: it rounds otherwise.)
* each schedule of the list through `capture_step`, against eager training with the same
  settings (`GraphSafeOptimizers.installed()`), bit for bit, captured once from the
  first replay on: OneCycleLR and CyclicLR cycling AdamW's, Adam's and SGD's momentum,
  ChainedScheduler, SequentialLR, ReduceLROnPlateau, transformers' cosine and linear
  warm-up schedules, timm's CosineLRScheduler (skipped without timm).

Run: DDPGRAPH_GPU_WORLD=1 python -m pytest tests/gpu/test_schedules_gpu.py -q
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from torch.optim import lr_scheduler as lrs

import ddpgraph
from ddpgraph.optimizer.kernel_support import kernel_support
from ddpgraph.optimizer.safe_optimizers import GraphSafeOptimizers
from own_update_check import CYCLE, params, same_steps

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda", 0)
STEPS = 16


def _note(text: str) -> None:
    # A warning, so that the number reaches the run's summary without `-s`.
    warnings.warn(text, stacklevel=2)


# ------------------------------------------------------------------ the own updates
@pytest.mark.parametrize(
    ("cls", "decay", "amsgrad", "maximize"),
    list(
        itertools.product(
            [torch.optim.Adam, torch.optim.AdamW], [0.0, 0.05], [False, True], [False, True]
        )
    ),
)
@pytest.mark.parametrize("cycled", [False, True], ids=["fixed", "cycled"])
def test_own_adam_update_is_the_capturable_cuda_kernel_bit_for_bit(
    cls: type[Optimizer], decay: float, amsgrad: bool, maximize: bool, cycled: bool
) -> None:
    def make(ps: list[nn.Parameter]) -> Optimizer:
        lr = torch.tensor(0.01, device=DEV)
        return cls(
            ps,
            lr=lr,
            weight_decay=decay,
            amsgrad=amsgrad,
            maximize=maximize,
            capturable=True,
            foreach=True,
        )

    values = [(b if cycled else 0.9, 0.99) for b in CYCLE]
    assert same_steps(make, make, "betas", values, torch.float32, DEV)


SGD_OPTIONS = [
    v
    for v in itertools.product(
        [0.0, 0.9], [0.0, 0.1], [False, True], [0.0, 0.05], [False, True], ["fixed", "cycled"]
    )
    if not (v[2] and (v[0] == 0 or v[1] != 0)) and not (v[0] == 0 and v[5] == "cycled")
]


@pytest.mark.parametrize(
    ("momentum", "dampening", "nesterov", "decay", "maximize", "values"), SGD_OPTIONS
)
def test_own_sgd_update_is_the_foreach_cuda_kernel_bit_for_bit(
    momentum: float, dampening: float, nesterov: bool, decay: float, maximize: bool, values: str
) -> None:
    lr = 0.0123
    kw = {
        "momentum": momentum,
        "dampening": dampening,
        "nesterov": nesterov,
        "weight_decay": decay,
        "maximize": maximize,
    }

    def make(ps: list[nn.Parameter]) -> Optimizer:
        return torch.optim.SGD(ps, lr=lr, foreach=True, **kw)

    def make_ours(ps: list[nn.Parameter]) -> Optimizer:
        opt = make(ps)
        opt.param_groups[0]["lr"] = torch.tensor(lr, device=DEV)  # the mirror's tensor
        return opt

    momenta = list(CYCLE) if values == "cycled" else [momentum] * len(CYCLE)
    assert same_steps(make, make_ours, "momentum", momenta, torch.float32, DEV)


def test_how_far_the_own_sgd_update_is_from_the_fused_kernel() -> None:
    """Printed, never asserted: fused SGD computes in double inside one kernel."""
    theirs, ours = params(torch.float32, DEV), params(torch.float32, DEV)
    fused = torch.optim.SGD(
        theirs, lr=0.0123, momentum=0.9, nesterov=True, weight_decay=1e-4, fused=True
    )
    plain = torch.optim.SGD(
        ours, lr=0.0123, momentum=0.9, nesterov=True, weight_decay=1e-4, foreach=True
    )
    for k in range(20):
        g = torch.Generator().manual_seed(k)
        for a, b in zip(theirs, ours, strict=True):
            a.grad = torch.randn(a.shape, generator=g).to(DEV)
            b.grad = a.grad.clone()
        fused.step()
        plain.step()
    worst = max(
        float(((a - b).abs().max() / a.abs().max()).item())
        for a, b in zip(theirs, ours, strict=True)
    )
    _note(
        "foreach SGD (what the own update computes) against fused SGD after 20 steps: "
        f"{worst:.3g} relative"
    )


def test_what_the_cuda_kernels_take_is_probed() -> None:
    found = {}
    for name, make in {
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
    }.items():
        opt = make(params(torch.float32, DEV))
        support = kernel_support(opt, opt.param_groups[0])
        found[name] = (support.tensor_keys, support.own_keys)
    _note(f"tensor keys, own-update keys: {found}")
    assert found["AdamW"][0][:1] == ("lr",) and "lr" in found["SGD momentum"][0]
    # Where PyTorch's kernel does not take the cycled value as a tensor, the own update does.
    for name, key in (("AdamW", "betas"), ("AdamW fused", "betas"), ("SGD momentum", "momentum")):
        tensor_keys, own_keys = found[name]
        assert key in tensor_keys or key in own_keys, (name, found[name])


# ------------------------------------------------------------------ the schedules
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 8)).to(DEV)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g))
        for _ in range(STEPS)
    ]


def _adamw(ps: Any) -> Optimizer:
    return torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)


def _sgd(ps: Any) -> Optimizer:
    return torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-4)


def _timm_cosine(opt: Optimizer) -> Any:
    scheduler = pytest.importorskip("timm.scheduler")
    return scheduler.CosineLRScheduler(
        opt, t_initial=STEPS, warmup_t=3, warmup_lr_init=1e-5, t_in_epochs=False
    )


def _hf(name: str) -> Callable[[Optimizer], Any]:
    def make(opt: Optimizer) -> Any:
        transformers = pytest.importorskip("transformers")
        return getattr(transformers, name)(opt, num_warmup_steps=3, num_training_steps=STEPS)

    return make


CASES: dict[str, tuple[Callable[[Any], Optimizer], Callable[[Optimizer], Any]]] = {
    "AdamW-OneCycleLR": (_adamw, lambda o: lrs.OneCycleLR(o, max_lr=1e-2, total_steps=STEPS + 1)),
    "SGD-nesterov-OneCycleLR": (
        _sgd,
        lambda o: lrs.OneCycleLR(o, max_lr=5e-2, total_steps=STEPS + 1),
    ),
    "SGD-CyclicLR": (_sgd, lambda o: lrs.CyclicLR(o, base_lr=1e-3, max_lr=5e-2, step_size_up=3)),
    "Adam-CyclicLR": (
        lambda ps: torch.optim.Adam(ps, lr=1e-3),
        lambda o: lrs.CyclicLR(o, base_lr=1e-4, max_lr=1e-2, step_size_up=3),
    ),
    "SGD-ChainedScheduler": (
        _sgd,
        lambda o: lrs.ChainedScheduler(
            [
                lrs.LinearLR(o, start_factor=0.5, total_iters=4),
                lrs.CyclicLR(o, base_lr=1e-3, max_lr=5e-2, step_size_up=3),
            ]
        ),
    ),
    "AdamW-SequentialLR": (
        _adamw,
        lambda o: lrs.SequentialLR(
            o,
            [
                lrs.LinearLR(o, start_factor=0.1, total_iters=3),
                lrs.CosineAnnealingLR(o, T_max=STEPS),
            ],
            milestones=[3],
        ),
    ),
    "AdamW-ReduceLROnPlateau": (
        _adamw,
        lambda o: lrs.ReduceLROnPlateau(o, factor=0.5, patience=1, threshold=0.9),
    ),
    "AdamW-hf-cosine": (_adamw, _hf("get_cosine_schedule_with_warmup")),
    "AdamW-hf-linear": (_adamw, _hf("get_linear_schedule_with_warmup")),
    "AdamW-timm-CosineLRScheduler": (_adamw, _timm_cosine),
}


def _train(
    make_opt: Callable[[Any], Optimizer], schedule: Callable[[Optimizer], Any], *, captured: bool
) -> tuple[list[torch.Tensor], Any, list[Any]]:
    model = _model()
    opt = make_opt(model.parameters())
    sched = schedule(opt)

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach()

    if captured:
        step: Any = ddpgraph.capture_step(fn, model=model, optimizer=opt)
    else:
        safe = GraphSafeOptimizers([opt], DEV)
        assert safe.prepare() is None

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with safe.installed():
                return fn(x, y)

    torch.manual_seed(1)
    seen = []
    for i, (x, y) in enumerate(_data()):
        loss = float(step(x.to(DEV), y.to(DEV)))
        if isinstance(sched, lrs.ReduceLROnPlateau):
            sched.step(loss)
        elif hasattr(sched, "step_update"):  # timm: per-iteration updates
            sched.step_update(num_updates=i + 1)
        else:
            sched.step()
        group = opt.param_groups[0]
        seen.append(
            (getattr(step, "state", None), group["lr"], group.get("betas"), group.get("momentum"))
        )
    torch.cuda.synchronize()
    out = [p.detach().clone() for p in model.parameters()]
    if captured:
        step.close()
    return out, step, seen


@pytest.mark.parametrize("case", list(CASES))
def test_a_schedule_stays_captured_and_equals_graph_safe_eager_bit_for_bit(case: str) -> None:
    make_opt, schedule = CASES[case]
    expected, _, _ = _train(make_opt, schedule, captured=False)
    got, step, seen = _train(make_opt, schedule, captured=True)
    states = [s[0].value for s in seen]
    first = states.index("captured")
    assert states[first:] == ["captured"] * (STEPS - first), (states, step.reason)
    assert step.reason is None and step.stats.captures == 1, step.reason
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    # The schedule changed something after capture, or the comparison proves nothing.
    after = seen[first:]
    assert len({repr(s[1:]) for s in after}) > 1, after
    assert all(not isinstance(v, torch.Tensor) for s in seen for v in s[1:2])


def test_per_replay_cost_with_a_cycled_momentum() -> None:
    """Printed, never asserted: the host time `before_replay` adds to each replay when
    OneCycleLR changes the learning rate and AdamW's betas[0] before every replay."""
    model = _model()
    opt = _adamw(model.parameters())
    safe = GraphSafeOptimizers([opt], DEV)
    assert safe.prepare() is None
    for i in range(3):  # a schedule's changes while warming up: the own update is chosen
        opt.param_groups[0]["betas"] = (0.9 - 0.01 * i, 0.999)
        with safe.installed():
            pass
    safe.captured()
    group = opt.param_groups[0]
    for label, change in (("nothing", False), ("lr and betas", True)):
        start = time.perf_counter()
        for i in range(2000):
            if change:
                group["lr"], group["betas"] = 1e-3 * (1 + i % 2), (0.85 + 0.01 * (i % 2), 0.999)
            assert safe.before_replay() is None
        _note(
            f"before_replay with the own update, {label} changed: "
            f"{(time.perf_counter() - start) / 2000 * 1e6:.2f} us"
        )
