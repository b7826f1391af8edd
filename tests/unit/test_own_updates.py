"""ddpgraph's own Adam, AdamW and SGD updates (`own_updates`, `own_step`): bit for bit what
PyTorch's kernel computes with the Python number, at fixed values and with the value
changed before every step, for every option they take; installed as `optimizer.step`
only while ddpgraph runs it, with the optimizer's hooks and an LR scheduler's wrapper
kept working.

On CPU, PyTorch's capturable Adam refuses CPU tensors by a device check only; with the
check widened (`_capturable_on_cpu`) its own capturable foreach code runs here, the code
the Adam update reproduces. tests/gpu/test_schedules_gpu.py runs the same comparison
(tests/own_update_check.py) with the CUDA kernels themselves.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.optim.adam as torch_adam
from torch.optim import Optimizer

from ddpgraph.optimizer.kernel_support import kernel_support
from ddpgraph.optimizer.own_step import OwnStep
from ddpgraph.optimizer.own_updates import own_update
from own_update_check import CYCLE, params, same_steps

CPU = torch.device("cpu")


@contextmanager
def _capturable_on_cpu() -> Iterator[None]:
    original = torch_adam._get_capturable_supported_devices
    torch_adam._get_capturable_supported_devices = lambda supports_xla=True: ["cuda", "cpu"]  # type: ignore[assignment]
    try:
        yield
    finally:
        torch_adam._get_capturable_supported_devices = original  # type: ignore[assignment]


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    return params(dtype, CPU)


def _set_grads(ps: list[torch.nn.Parameter]) -> None:
    for p in ps:
        p.grad = torch.ones_like(p)


ADAM_VARIANTS = list(
    itertools.product(
        [torch.optim.Adam, torch.optim.AdamW],
        [0.0, 0.05],
        [False, True],
        [False, True],
        [torch.float32, torch.float64],
    )
)


@pytest.mark.parametrize(("cls", "decay", "amsgrad", "maximize", "dtype"), ADAM_VARIANTS)
@pytest.mark.parametrize("cycled", [False, True], ids=["fixed", "cycled"])
def test_adam_update_is_the_capturable_foreach_kernel_bit_for_bit(
    cls: type[Optimizer],
    decay: float,
    amsgrad: bool,
    maximize: bool,
    dtype: torch.dtype,
    cycled: bool,
) -> None:
    def make(params: list[torch.nn.Parameter]) -> Optimizer:
        lr = torch.tensor(0.01)  # the mirror's tensor learning rate
        return cls(
            params,
            lr=lr,
            weight_decay=decay,
            amsgrad=amsgrad,
            maximize=maximize,
            capturable=True,
            foreach=True,
        )

    values = [(b if cycled else 0.9, 0.99) for b in CYCLE]
    with _capturable_on_cpu():
        assert same_steps(make, make, "betas", values, dtype, CPU)


SGD_VARIANTS = [
    v
    for v in itertools.product(
        [0.0, 0.9],
        [0.0, 0.1],
        [False, True],
        [0.0, 0.05],
        [False, True],
        [torch.float32, torch.float64],
        ["fixed", "cycled"],
    )
    # nesterov needs momentum and no dampening; a momentum of 0 has no buffer to cycle
    if not (v[2] and (v[0] == 0 or v[1] != 0)) and not (v[0] == 0 and v[6] == "cycled")
]


@pytest.mark.parametrize(
    ("momentum", "dampening", "nesterov", "decay", "maximize", "dtype", "values"), SGD_VARIANTS
)
def test_sgd_update_is_the_foreach_kernel_bit_for_bit(
    momentum: float,
    dampening: float,
    nesterov: bool,
    decay: float,
    maximize: bool,
    dtype: torch.dtype,
    values: str,
) -> None:
    lr = 0.0123

    def make(params: list[torch.nn.Parameter]) -> Optimizer:
        kw = {
            "momentum": momentum,
            "dampening": dampening,
            "nesterov": nesterov,
            "weight_decay": decay,
        }
        return torch.optim.SGD(params, lr=lr, maximize=maximize, foreach=True, **kw)

    def make_ours(params: list[torch.nn.Parameter]) -> Optimizer:
        opt = make(params)
        # The learning rate from a tensor of the parameters' precision: the foreach
        # kernel multiplies by the Python number in that precision.
        opt.param_groups[0]["lr"] = torch.tensor(lr, dtype=dtype)
        return opt

    momenta = list(CYCLE) if values == "cycled" else [momentum] * len(CYCLE)
    assert same_steps(make, make_ours, "momentum", momenta, dtype, CPU)


def test_an_own_step_keeps_hooks_closures_and_the_schedulers_wrapper() -> None:
    ps = _params(torch.float32)
    opt = torch.optim.AdamW(ps, lr=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10)
    wrapper = opt.__dict__["step"]  # the scheduler's, which notes that step ran
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    update = own_update(opt)
    assert update is not None
    own = OwnStep(opt, update, CPU)
    assert own.fill(0, opt.param_groups[0]["betas"])
    _set_grads(ps)
    opt._opt_called = False  # type: ignore[attr-defined]
    own.install()
    assert opt.step is not wrapper
    loss = opt.step(lambda: torch.tensor(1.5))
    own.uninstall()
    assert loss == 1.5 and calls == ["pre", "post"]
    assert opt._opt_called is True  # type: ignore[attr-defined]
    assert opt.__dict__["step"] is wrapper
    sched.step()  # no "lr_scheduler.step() before optimizer.step()" warning to expect: noted


def test_an_optimizer_without_a_wrapped_step_gets_its_own_step_back() -> None:
    opt = torch.optim.SGD(_params(torch.float32), lr=0.1, momentum=0.9)
    update = own_update(opt)
    assert update is not None
    own = OwnStep(opt, update, CPU)
    own.install()
    own.uninstall()
    assert "step" not in opt.__dict__


def test_the_own_update_is_offered_where_it_computes_what_the_kernel_does() -> None:
    def support(
        dtype: torch.dtype, cls: type[Optimizer] = torch.optim.AdamW, **kw: Any
    ) -> tuple[str, ...]:
        opt = cls([torch.nn.Parameter(torch.zeros(3, dtype=dtype))], lr=0.1, **kw)
        return kernel_support(opt, opt.param_groups[0]).own_keys

    assert support(torch.float32) == ("betas",)
    assert support(torch.float64, amsgrad=True) == ("betas",)
    assert support(torch.float32, torch.optim.SGD, momentum=0.9, nesterov=True) == ("momentum",)
    # A 0-dim float32 factor is cast to a bfloat16 parameter's dtype, where the kernel
    # keeps the Python number in float32: not the same bits, so not offered.
    assert support(torch.bfloat16) == ()
    assert support(torch.float32, torch.optim.RMSprop) == ()
    assert support(torch.float32, differentiable=True) == ()


def test_a_live_value_of_another_form_is_not_filled() -> None:
    opt = torch.optim.AdamW(_params(torch.float32), lr=0.1)
    update = own_update(opt)
    assert update is not None
    own = OwnStep(opt, update, CPU)
    assert own.fill(0, (0.8, 0.999))
    assert own.live[0]["one_minus_beta1"][torch.float32].item() == pytest.approx(0.2)
    # Derived on the host in double, rounded once: not 1 - float32(0.8).
    assert own.live[0]["one_minus_beta1"][torch.float32].item() == torch.tensor(1 - 0.8).item()
    assert not own.fill(0, (torch.tensor(0.7), 0.999))
    assert not own.fill(0, 0.8)
