"""`graph_safe_optimizer` (the conversion for good): refusals, the learning rate in a
tensor; the LR_BAKED finding."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim import Optimizer

from ddpgraph import Code, DdpGraphError, graph_safe_optimizer
from ddpgraph.optimizer.graph_safe import HyperparamChange, baked_finding, capture_support


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]


def _step(opt: Optimizer) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    opt.step()


def _groups(opt: Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


@pytest.mark.parametrize("cls", [torch.optim.Adagrad, torch.optim.LBFGS])
def test_refuses_optimizer_without_capturable_mode_and_changes_nothing(
    cls: type[Optimizer],
) -> None:
    opt = cls(_params(), lr=0.1)
    groups, defaults = copy.deepcopy(_groups(opt)), copy.deepcopy(opt.defaults)
    with pytest.raises(DdpGraphError) as info:
        graph_safe_optimizer(opt, tensor_lr_on_cpu=True)
    assert info.value.code is Code.OPTIMIZER_NOT_CAPTURABLE
    text = str(info.value)
    assert f"`{cls.__name__}`" in text and f"{cls.__name__} has no capturable mode" in text
    assert "HINT:" in text
    assert _groups(opt) == groups
    assert opt.defaults == defaults
    assert isinstance(opt.param_groups[0]["lr"], float)


def test_capture_support() -> None:
    params = _params()
    assert capture_support(torch.optim.SGD(params, lr=0.1)) == "fused"
    assert capture_support(torch.optim.AdamW(params)) == "capturable"
    assert capture_support(torch.optim.Adagrad(params)) is None


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD])
def test_cpu_optimizer_is_left_alone_by_default(cls: type[Optimizer]) -> None:
    opt = cls(_params(), lr=0.1)
    groups = copy.deepcopy(_groups(opt))
    assert graph_safe_optimizer(opt) is opt
    assert _groups(opt) == groups


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop])
def test_tensor_lr_on_cpu_holds_lr_in_a_0dim_float32_tensor(cls: type[Optimizer]) -> None:
    opt = cls(_params(), lr=0.1)
    graph_safe_optimizer(opt, tensor_lr_on_cpu=True)
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor)
    assert lr.dim() == 0 and lr.dtype == torch.float32 and lr.device.type == "cpu"
    assert lr.item() == pytest.approx(0.1)
    graph_safe_optimizer(opt, tensor_lr_on_cpu=True)  # idempotent: the same tensor stays
    assert opt.param_groups[0]["lr"] is lr
    _step(opt)  # and the optimizer still steps with it
    assert opt.param_groups[0]["lr"] is lr


def test_tensor_lr_from_a_float64_tensor_is_converted() -> None:
    opt = torch.optim.AdamW(_params(), lr=torch.tensor(0.25, dtype=torch.float64))
    graph_safe_optimizer(opt, tensor_lr_on_cpu=True)
    lr = opt.param_groups[0]["lr"]
    assert lr.dtype == torch.float32 and lr.dim() == 0 and lr.item() == 0.25


def _lambda(opt: Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _cosine(opt: Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)


@pytest.mark.parametrize("schedule", [_lambda, _cosine], ids=["LambdaLR", "CosineAnnealingLR"])
def test_scheduler_changes_the_tensor_lr_in_place(
    schedule: Callable[[Optimizer], torch.optim.lr_scheduler.LRScheduler],
) -> None:
    opt = torch.optim.AdamW(_params(), lr=0.1)
    graph_safe_optimizer(opt, tensor_lr_on_cpu=True)
    lr = opt.param_groups[0]["lr"]
    sched = schedule(opt)
    plain = torch.optim.AdamW(_params(), lr=0.1)  # the same schedule on a float lr
    plain_sched = schedule(plain)
    seen, expected = [], []
    for _ in range(4):
        _step(opt)
        sched.step()
        _step(plain)
        plain_sched.step()
        assert opt.param_groups[0]["lr"] is lr  # what a captured graph keeps reading
        seen.append(lr.item())
        expected.append(plain.param_groups[0]["lr"])
    assert len(set(seen)) == 4  # a new value every step
    assert seen == pytest.approx(expected)


def test_baked_finding_names_the_optimizer_key_and_values() -> None:
    opt = torch.optim.SGD(_params(), lr=0.1, momentum=0.9)
    changes = [
        HyperparamChange(0, "lr", torch.tensor(0.1), 0.2, True),
        HyperparamChange(0, "momentum", 0.9, 0.5, False),
    ]
    finding = baked_finding(changes, opt)
    assert finding.code is Code.LR_BAKED_INTO_GRAPH
    assert finding.subject == "`optimizer.param_groups`"
    assert finding.happened == (
        "`SGD.param_groups[0]['momentum']` changed from 0.9 to 0.5 after capture; "
        "it is a Python value, frozen into the graph"
    )
    assert "`momentum`" in finding.hint
    assert finding.format().startswith("[LR_BAKED_INTO_GRAPH] `optimizer.param_groups`: `SGD.")


def test_baked_finding_for_added_param_groups() -> None:
    opt = torch.optim.AdamW(_params(), lr=0.1)
    finding = baked_finding([HyperparamChange(-1, "param_groups", 1, 2, False)], opt)
    assert finding.happened == "AdamW had 1 param group(s) at capture and has 2 now"
    # Not the wording of a hyper-parameter read as a Python number.
    assert "add_param_group" in finding.hint and "Python number" not in finding.hint
