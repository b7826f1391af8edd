"""GraphSafeGradScaler on CPU, against torch.amp.GradScaler doing the same training.

Every comparison is bit for bit: the scaler uses the same unscale kernel, the same
update schedule arithmetic and the same optimizer kernels as GradScaler; it only takes
the skip decision on the device instead of the host.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

import ddpgraph
from ddpgraph.training.scaler import GraphSafeGradScaler
from ddpgraph.training.scaler_state import DeviceState, update_schedule

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


# ------------------------------------------------------------------ the schedule arithmetic
def _device_state(
    scale: float, tracker: int, growth: float, backoff: float, interval: int
) -> DeviceState:
    return DeviceState(
        scale=torch.tensor(scale, dtype=torch.float32),
        growth_tracker=torch.tensor(tracker, dtype=torch.int32),
        skipped_steps=torch.tensor(0, dtype=torch.int64),
        found_inf=torch.tensor(0.0),
        growth_factor=torch.tensor(growth, dtype=torch.float64),
        backoff_factor=torch.tensor(backoff, dtype=torch.float64),
        growth_interval=torch.tensor(interval, dtype=torch.int32),
    )


@pytest.mark.parametrize(
    ("growth", "backoff", "interval", "start"),
    [
        (2.0, 0.5, 3, 2.0**16),
        (1.7, 0.37, 2, 1234.567),  # factors that float32 cannot hold exactly
        (3.0, 0.9, 1, 2.0**120),  # grows past float32's range: the scale must stay finite
        (1.0001, 0.999, 5, 1e-30),
    ],
)
def test_schedule_matches_torch_kernel_bit_for_bit(
    growth: float, backoff: float, interval: int, start: float
) -> None:
    rng = random.Random(0)
    ours = _device_state(start, 0, growth, backoff, interval)
    ref_scale = torch.tensor(start, dtype=torch.float32)
    ref_tracker = torch.tensor(0, dtype=torch.int32)
    skipped = 0
    for _ in range(300):
        found = torch.tensor(1.0 if rng.random() < 0.2 else 0.0)
        skipped += int(found.item())
        torch._amp_update_scale_(ref_scale, ref_tracker, found, growth, backoff, interval)
        update_schedule(ours, found)
        assert torch.equal(ours.scale, ref_scale), (ours.scale, ref_scale)
        assert torch.equal(ours.growth_tracker, ref_tracker)
        assert float(ours.found_inf) == float(found)
    assert int(ours.skipped_steps) == skipped
    assert torch.isfinite(ours.scale)


# ------------------------------------------------------------------ training against GradScaler
@dataclass
class Trace:
    scales: list[float] = field(default_factory=list)
    params: list[list[torch.Tensor]] = field(default_factory=list)
    states: list[list[torch.Tensor]] = field(default_factory=list)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _optimizer_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        v.detach().clone()
        for group in opt.param_groups
        for p in group["params"]
        for v in opt.state.get(p, {}).values()
        if isinstance(v, torch.Tensor)
    ]


def _train(
    scaler: Any,
    make_opt: OptimizerFactory,
    *,
    steps: int = 14,
    inject: frozenset[int] = frozenset(),
    clip: bool = False,
) -> Trace:
    """Train with `scaler` (GraphSafeGradScaler or torch.amp.GradScaler); at the steps in
    `inject` one gradient becomes inf inside backward."""
    model = _model()
    opt = make_opt(list(model.parameters()))
    poison = torch.zeros(())
    model[0].weight.register_hook(lambda g: g + poison)
    gen = torch.Generator().manual_seed(3)
    trace = Trace()
    for i in range(steps):
        poison.fill_(float("inf") if i in inject else 0.0)
        x, y = torch.randn(6, 8, generator=gen), torch.randint(0, 3, (6,), generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        trace.scales.append(scaler.get_scale())
        trace.params.append([p.detach().clone() for p in model.parameters()])
        trace.states.append(_optimizer_state(opt))
    return trace


OPTIMIZERS: dict[str, OptimizerFactory] = {
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
}
SCHEDULE: dict[str, Any] = {"init_scale": 2.0**10, "growth_interval": 3}


@pytest.mark.parametrize(("name", "clip"), list(itertools.product(OPTIMIZERS, [False, True])))
def test_training_matches_torch_grad_scaler(name: str, clip: bool) -> None:
    # Step 0 overflows before the optimizer has state (decided on the host, once);
    # 5 and 6 overflow in a row; 10 after growth.
    inject = frozenset({0, 5, 6, 10})
    ref = _train(
        torch.amp.GradScaler("cpu", **SCHEDULE), OPTIMIZERS[name], inject=inject, clip=clip
    )
    ours = _train(GraphSafeGradScaler(**SCHEDULE), OPTIMIZERS[name], inject=inject, clip=clip)
    assert ours.scales == ref.scales
    assert len(set(ref.scales)) > 2  # the scale backed off and grew
    for step, (a, b) in enumerate(zip(ours.params, ref.params, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (
            f"params differ at step {step}"
        )
    for step, (a, b) in enumerate(zip(ours.states, ref.states, strict=True)):
        if not a and all(not t.any() for t in b):
            continue  # a skipped first step: GradScaler's fused path creates zero state, ours none
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), step


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_skipped_step_leaves_parameters_and_state_unchanged(name: str) -> None:
    trace = _train(
        GraphSafeGradScaler(**SCHEDULE), OPTIMIZERS[name], steps=6, inject=frozenset({4})
    )
    assert all(torch.equal(a, b) for a, b in zip(trace.params[3], trace.params[4], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(trace.states[3], trace.states[4], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(trace.params[4], trace.params[5], strict=True))


def test_skipped_first_step_of_fused_sgd_leaves_no_uninitialised_momentum() -> None:
    """Under GradScaler, fused SGD's skipped first step keeps `empty_like` momentum buffers;
    here the first step is not run at all, so training equals the non-fused optimizer's."""
    fused = _train(
        GraphSafeGradScaler(**SCHEDULE),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
        steps=6,
        inject=frozenset({0}),
    )
    plain = _train(
        torch.amp.GradScaler("cpu", **SCHEDULE),
        OPTIMIZERS["sgd-momentum"],
        steps=6,
        inject=frozenset({0}),
    )
    assert fused.states[0] == [] and fused.scales == plain.scales
    for a, b in zip(fused.params, plain.params, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_read_reports_skips_with_one_call() -> None:
    scaler = GraphSafeGradScaler(init_scale=8.0, growth_interval=100)
    _train(scaler, OPTIMIZERS["adamw"], steps=5, inject=frozenset({1, 3}))
    stats = scaler.read()
    assert stats == ddpgraph.training.scaler.ScalerStats(
        scale=2.0, growth_tracker=1, skipped_steps=2, last_step_skipped=False
    )
    tensors = scaler.tensors
    assert tensors is not None and float(tensors.scale) == 2.0 and int(tensors.skipped_steps) == 2


def test_multiple_optimizers_skip_each_on_its_own_flag_and_back_off_together() -> None:
    def run(scaler: Any) -> tuple[list[float], list[torch.Tensor]]:
        a, b = _model(), _model()
        oa, ob = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.SGD(b.parameters(), lr=0.1)
        poison = torch.zeros(())
        a[0].weight.register_hook(lambda g: g + poison)
        gen = torch.Generator().manual_seed(5)
        scales = []
        for i in range(6):
            poison.fill_(float("inf") if i == 3 else 0.0)
            x = torch.randn(4, 8, generator=gen)
            oa.zero_grad()
            ob.zero_grad()
            scaler.scale(a(x).square().mean() + b(x).square().mean()).backward()
            scaler.step(oa)
            scaler.step(ob)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [p.detach().clone() for p in [*a.parameters(), *b.parameters()]]

    ref_scales, ref_params = run(torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=2))
    scales, params = run(GraphSafeGradScaler(init_scale=4.0, growth_interval=2))
    assert scales == ref_scales
    assert all(torch.equal(x, y) for x, y in zip(params, ref_params, strict=True))


# ------------------------------------------------------------------ checkpoints
def test_state_dict_is_interchangeable_with_torch_grad_scaler() -> None:
    ours = GraphSafeGradScaler(init_scale=64.0, growth_interval=3)
    _train(ours, OPTIMIZERS["adamw"], steps=4, inject=frozenset({2}))
    saved = ours.state_dict()
    assert saved == {
        "scale": 32.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 3,
        "_growth_tracker": 1,
        "skipped_steps": 1,
    }
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(saved)
    assert theirs.get_scale() == 32.0 and theirs._get_growth_tracker() == 1
    back = GraphSafeGradScaler()
    back.load_state_dict(theirs.state_dict())  # no skipped_steps key: kept
    assert back.read() == ddpgraph.training.scaler.ScalerStats(32.0, 1, 0, False)


def test_load_writes_into_the_live_tensors() -> None:
    scaler = GraphSafeGradScaler("cpu", init_scale=16.0)
    before = scaler.tensors
    assert before is not None
    scaler.load_state_dict(
        {
            "scale": 4.0,
            "growth_factor": 3.0,
            "backoff_factor": 0.25,
            "growth_interval": 7,
            "_growth_tracker": 2,
            "skipped_steps": 9,
        }
    )
    after = scaler.tensors
    assert after is not None
    assert all(a is b for a, b in zip(vars(before).values(), vars(after).values(), strict=True))
    assert scaler.read() == ddpgraph.training.scaler.ScalerStats(4.0, 2, 9, False)
    state = scaler._state
    assert state is not None
    assert float(state.growth_factor) == 3.0 and float(state.backoff_factor) == 0.25
    assert int(state.growth_interval) == 7


def test_setters_reach_the_device_schedule() -> None:
    scaler = GraphSafeGradScaler("cpu", init_scale=2.0, growth_interval=1)
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.125)
    scaler.set_growth_interval(2)
    state = scaler._state
    assert state is not None
    assert (
        float(state.growth_factor),
        float(state.backoff_factor),
        int(state.growth_interval),
    ) == (4.0, 0.125, 2)
    assert (
        scaler.get_growth_factor(),
        scaler.get_backoff_factor(),
        scaler.get_growth_interval(),
    ) == (4.0, 0.125, 2)


def test_snapshot_puts_state_and_stages_back() -> None:
    scaler = GraphSafeGradScaler("cpu", init_scale=8.0)
    restore = scaler.snapshot()
    _train(scaler, OPTIMIZERS["adamw"], steps=2, inject=frozenset({1}))
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    scaler.scale(model(torch.ones(1, 8)).sum()).backward()
    scaler.unscale_(opt)  # an iteration left half-done, as by a failed recording
    restore()
    assert scaler.read() == ddpgraph.training.scaler.ScalerStats(8.0, 0, 0, False)
    scaler.unscale_(opt)  # the half-done iteration is forgotten


# ------------------------------------------------------------------ misuse
def test_disabled_scaler_is_a_pass_through() -> None:
    scaler = GraphSafeGradScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss
    assert scaler.state_dict() == {} and scaler.get_scale() == 1.0 and not scaler.is_enabled()
    _train(scaler, OPTIMIZERS["adamw"], steps=2)


def test_misuse_is_reported_in_the_standard_form() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    scaler = GraphSafeGradScaler()
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="before any loss was scaled"):
        scaler.step(opt)
    scaler.scale(model(torch.ones(2, 8)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="already called") as info:
        scaler.unscale_(opt)
    assert "HINT:" in str(info.value) and "`GraphSafeGradScaler.unscale_`" in str(info.value)
    scaler.step(opt)
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="already called"):
        scaler.step(opt)
    scaler.update()
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="no optimizer was unscaled"):
        scaler.update()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"init_scale": float("inf")}, "init_scale"),
    ],
)
def test_schedule_arguments_are_checked(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ddpgraph.DdpGraphUsageError, match=name):
        GraphSafeGradScaler(**kwargs)


def test_fp16_gradients_are_refused() -> None:
    p = nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GraphSafeGradScaler("cpu")
    p.grad = torch.ones(3, dtype=torch.float16)
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="float16 gradients"):
        scaler.unscale_(opt)


class _CountingSGD(torch.optim.SGD):
    """Keeps a Python number in its state, which a device-side skip cannot undo."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["count"] = self.state[p].get("count", 0) + 1
        return super().step(closure)


def test_python_number_state_is_refused_with_the_fix() -> None:
    model = _model()
    opt = _CountingSGD(model.parameters(), lr=0.1)
    scaler = GraphSafeGradScaler()
    for _ in range(2):
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 8)).sum()).backward()
        if opt.state:
            with pytest.raises(ddpgraph.DdpGraphError, match="capturable=True") as info:
                scaler.step(opt)
            assert info.value.code is ddpgraph.Code.OPTIMIZER_NOT_CAPTURABLE
            return
        scaler.step(opt)
        scaler.update()
    pytest.fail("the second step was not refused")


def test_capture_step_refuses_torch_grad_scaler(make_run: Any) -> None:
    run = make_run()
    with pytest.raises(ddpgraph.DdpGraphUsageError) as info:
        run.capture(scaler=torch.amp.GradScaler("cpu"))
    assert info.value.code is ddpgraph.Code.GRAD_SCALER_IN_CAPTURE
    assert "GraphSafeGradScaler" in str(info.value)
