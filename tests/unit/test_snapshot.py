"""Undoing a step on CPU: every value a training step changes comes back, in the same tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpgraph.step.snapshot import TrainingSnapshot


def _setup() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2), nn.Linear(2, 2)
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return model, opt


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, *, freeze_last: bool = False) -> None:
    opt.zero_grad(set_to_none=True)
    x = torch.randn(6, 4)  # consumes the RNG, as does dropout
    out = model[:4](x) if freeze_last else model(x)  # skipping the last layer: no grad for it
    out.sum().backward()
    opt.step()


def _values(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def test_restore_puts_back_parameters_buffers_and_rng() -> None:
    model, opt = _setup()
    _train_step(model, opt)
    params = list(model.parameters())
    before = _values(model)
    snap = TrainingSnapshot([model], [opt])
    expected_draw = torch.rand(5)
    torch.set_rng_state(snap.cpu_rng)

    _train_step(model, opt)
    assert not all(torch.equal(a, b) for a, b in zip(before, _values(model), strict=True))
    snap.restore()

    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before, _values(model), strict=True))
    assert torch.equal(torch.rand(5), expected_draw)


def test_restore_keeps_rng_when_asked() -> None:
    model, opt = _setup()
    snap = TrainingSnapshot([model], [opt])
    torch.rand(3)
    state = torch.get_rng_state()
    snap.restore(rng=False)
    assert torch.equal(torch.get_rng_state(), state)


def test_restore_puts_back_grads_values_and_none() -> None:
    model, opt = _setup()
    _train_step(model, opt, freeze_last=True)
    frozen = model[4].weight
    assert frozen.grad is None
    grads = {id(p): p.grad for p in model.parameters() if p.grad is not None}
    grad_values = {k: g.clone() for k, g in grads.items()}
    snap = TrainingSnapshot([model], [opt])

    _train_step(model, opt)  # now every parameter has a new grad
    assert frozen.grad is not None
    snap.restore()

    assert frozen.grad is None
    for p in model.parameters():
        if id(p) in grads:
            assert p.grad is grads[id(p)]
            assert torch.equal(p.grad, grad_values[id(p)])


def test_restore_puts_back_optimizer_state_and_groups() -> None:
    model, opt = _setup()
    _train_step(model, opt, freeze_last=True)
    frozen = model[4].weight
    assert frozen not in opt.state  # no grad yet, no state
    state = {p: {k: v for k, v in s.items()} for p, s in opt.state.items()}
    values = {p: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    snap = TrainingSnapshot([model], [opt])

    _train_step(model, opt)
    opt.param_groups[0]["lr"] = 0.5
    opt.param_groups[0]["new_key"] = 1
    snap.restore()

    assert frozen not in opt.state  # state made after the snapshot is gone
    assert set(opt.state) == set(state)
    for p, s in opt.state.items():
        assert set(s) == set(state[p])
        for k, v in s.items():
            assert v is state[p][k]  # the same tensors, which a graph would be reading
            assert torch.equal(v, values[p][k]), (k, v, values[p][k])
    assert opt.param_groups[0]["lr"] == 0.1
    assert "new_key" not in opt.param_groups[0]


def test_restore_puts_back_a_tensor_lr_in_place() -> None:
    model, opt = _setup()
    opt.param_groups[0]["lr"] = lr = torch.tensor(0.1)
    snap = TrainingSnapshot([model], [opt])
    lr.fill_(0.3)
    snap.restore()
    assert opt.param_groups[0]["lr"] is lr
    assert lr.item() == pytest.approx(0.1)


def test_shared_parameters_are_restored_once() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    model = nn.Sequential(lin, nn.Tanh(), lin)  # the same parameters twice
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _values(model)
    snap = TrainingSnapshot([model, lin], [opt])
    assert len(snap.params) == 2
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    snap.restore()
    assert all(torch.equal(a, b) for a, b in zip(before, _values(model), strict=True))
    assert lin.weight.grad is None


def test_step_after_restore_repeats_the_undone_step_exactly() -> None:
    """What a failed capture relies on: undo, then run the step again eagerly."""
    model, opt = _setup()
    _train_step(model, opt)
    snap = TrainingSnapshot([model], [opt])
    _train_step(model, opt)
    once = _values(model)
    snap.restore()
    _train_step(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(once, _values(model), strict=True))


def test_restore_to_a_fresh_model_drops_all_grads_and_state() -> None:
    model, opt = _setup()
    before = _values(model)
    snap = TrainingSnapshot([model], [opt])
    _train_step(model, opt)
    snap.restore()
    assert all(p.grad is None for p in model.parameters())
    assert len(opt.state) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, _values(model), strict=True))
