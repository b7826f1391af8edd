"""Python state outside the step that the step changes on every call (a list it appends
to, a counter, its object's attribute, an iterator it takes batches from): replays run no
Python, so it would stop changing after capture. The step is refused at the line that
changes it, and training goes on eagerly, as without capture_step
(`frozen/outside_state.py`). State set once, or to the same value on every call, and
tensors the step rebinds or updates in place, stay captured."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddpgraph
from ddpgraph import Code, StepState
from ddpgraph.backends.recording import RecordingBackend
from ddpgraph.frozen.outside_state import OutsideState

BACKENDS = [RecordingBackend, ddpgraph.PassThroughBackend]
COUNT = 0  # a module-level counter the step below increments with `global`


def _global_counter(run: Any) -> Callable[..., torch.Tensor]:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        global COUNT
        COUNT += 1
        return run.step(x, y)

    return step


def _nonlocal_counter(run: Any) -> Callable[..., torch.Tensor]:
    n = 0

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        nonlocal n
        n += 1
        return run.step(x, y)

    return step


def _history(run: Any) -> Callable[..., torch.Tensor]:
    history: list[torch.Tensor] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = run.step(x, y)
        history.append(loss)
        return loss

    return step


class _Trainer:
    def __init__(self, run: Any) -> None:
        self.run, self.global_step = run, 0

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.run.step(x, y)
        self.global_step += 1
        return loss


def _next_batch(run: Any, data: list[Any]) -> Callable[..., torch.Tensor]:
    it = iter(data * 2)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        xb, yb = next(it)
        return run.step(xb, yb)

    return step


def _graph_safe(run: Any, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fn` run eagerly in the graph-safe mode capture_step's eager steps run in."""

    def call(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with run.safe.installed():
            return fn(x, y)

    return call


# (name, make the step, what the finding says, the source of the line it names)
CHANGED: list[tuple[str, Any, str, str]] = [
    ("global", lambda run, data: _global_counter(run), "the step changes `COUNT`", "COUNT += 1"),
    ("nonlocal", lambda run, data: _nonlocal_counter(run), "the step changes `n`", "n += 1"),
    ("list", lambda run, data: _history(run), "the step changes `history`", "history.append(loss)"),
    (
        "attribute",
        lambda run, data: _Trainer(run).train_step,
        "the step changes `self.global_step`",
        "self.global_step += 1",
    ),
    ("iterator", _next_batch, "the step changes `it`", "xb, yb = next(it)"),
]


class _Average:
    """A running average of the loss, kept by rebinding (`avg = avg * 0.9 + ...`)."""

    def __init__(self) -> None:
        self.value = torch.zeros(())


def _running_average(run: Any) -> Callable[..., torch.Tensor]:
    average = _Average()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = run.step(x, y)
        average.value = average.value * 0.9 + loss * 0.1
        return loss

    return step


def _best_in_dict(run: Any) -> Callable[..., torch.Tensor]:
    best = {"loss": torch.full((), float("inf"))}

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = run.step(x, y)
        best["loss"] = torch.minimum(best["loss"], loss)
        return loss

    return step


# Tensors outside the step that it reads and rebinds: replays would read the recorded one.
REPLACED: list[tuple[str, Any, str, str]] = [
    (
        "running_average",
        lambda run, data: _running_average(run),
        "the step replaces `average.value`, a tensor outside it that it reads",
        "average.value = average.value * 0.9 + loss * 0.1",
    ),
    (
        "best_in_dict",
        lambda run, data: _best_in_dict(run),
        "the step replaces `best['loss']`, a tensor outside it that it reads",
        'best["loss"] = torch.minimum(best["loss"], loss)',
    ),
]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("case", CHANGED + REPLACED, ids=[c[0] for c in CHANGED + REPLACED])
def test_state_the_step_changes_is_refused_at_its_line(
    make_run, batches, same, backend, case
) -> None:
    _, make_step, said, source = case
    data = batches(16)
    ref, run = make_run(graph_safe=True, fused=True), make_run(fused=True)
    expected = ref.train(data, _graph_safe(ref, make_step(ref, data)))
    captured = ddpgraph.capture_step(
        make_step(run, data), model=run.model, optimizer=run.optimizer, backend=backend()
    )
    got = run.train(data, captured)
    assert captured.state is StepState.EAGER and captured.stats.replays == 0
    reason = captured.reason
    assert reason is not None and reason.code is Code.FROZEN_PYTHON_VALUE, reason
    assert said in reason.happened, reason.happened
    assert reason.location is not None and reason.location.source == source
    assert reason.location.filename == __file__
    # Refused before anything was captured: training as eager, no step lost or repeated.
    assert got.losses == expected.losses and same(run.params(), ref.params())


class _Counting(nn.Module):
    """A model of the user's that counts its forwards in an attribute."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.forwards = inner, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return self.inner(x)


def _captured_sgd(model: nn.Module) -> ddpgraph.CapturedStep[torch.Tensor]:
    """`model` trained by SGD on cross-entropy, captured with the recording backend."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return ddpgraph.capture_step(step, model=model, optimizer=opt, backend=RecordingBackend())


def test_a_counter_in_the_users_model_is_named_in_its_forward(batches) -> None:
    torch.manual_seed(0)
    model = _Counting(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    captured = _captured_sgd(model)
    for x, y in batches(14):
        captured(x, y)
    reason = captured.reason
    assert reason is not None and reason.code is Code.FROZEN_PYTHON_VALUE
    assert "`model.forwards`" in reason.happened
    assert reason.location is not None and reason.location.source == "self.forwards += 1"


def test_state_set_once_or_to_the_same_value_and_tensors_stay_captured(
    make_run, batches, same
) -> None:
    data = batches(16)
    ref, run = make_run(graph_safe=True, fused=True), make_run(fused=True)

    def make_step(run: Any, keep: dict[str, Any]) -> Callable[..., torch.Tensor]:
        total = torch.zeros(())

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            keep.setdefault("sizes", {})[tuple(x.shape)] = "seen"  # a cache, filled once
            keep["mode"] = "train"  # the same value on every call
            loss = run.step(x, y)
            keep["last"] = loss  # a tensor rebound: the graph's output, refreshed by replays
            total.add_(loss)  # a tensor updated in place: the graph does it
            keep["total"] = total
            return loss

        return step

    kept_ref: dict[str, Any] = {}
    expected = ref.train(data, _graph_safe(ref, make_step(ref, kept_ref)))
    kept: dict[str, Any] = {}
    captured = ddpgraph.capture_step(
        make_step(run, kept), model=run.model, optimizer=run.optimizer, backend=RecordingBackend()
    )
    got = run.train(data, captured)
    assert captured.state is StepState.CAPTURED and captured.reason is None
    assert captured.stats.replays == 16 - 11
    assert got.losses == expected.losses and same(run.params(), ref.params())
    assert torch.equal(kept["total"], kept_ref["total"])
    assert torch.equal(kept["last"], kept_ref["last"])


def test_what_is_watched_is_the_users_and_not_a_librarys() -> None:
    class Mine:
        def __init__(self) -> None:
            self.count = 0
            self.model = nn.Linear(2, 2)  # torch's: not entered

    mine = Mine()
    sgd = torch.optim.SGD(mine.model.parameters(), lr=0.1)

    def step() -> None:
        mine.count += 1
        sgd.step()

    state = OutsideState(step)
    snapshot = state.snapshot()
    assert snapshot["mine.count"] == ("int", 0)
    assert not any(path.startswith("sgd") or path.startswith("mine.model.") for path in snapshot)
    step()
    assert state.changes(snapshot) == {"mine.count": (("int", 0), ("int", 1))}


class _CallCounter:
    """A forward hook of the user's, as an object that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self.calls += 1


def _closure_hook() -> Callable[..., None]:
    seen = 0

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        nonlocal seen
        seen += 1

    return hook


def _tensor_hook() -> Callable[..., None]:
    norms: list[torch.Tensor] = []

    def hook(parameter: torch.Tensor) -> None:
        norms.append(parameter.grad.norm())

    return hook


# (name, register the hook on the model, the path the finding names, its line's source)
HOOKS: list[tuple[str, Any, str, str]] = [
    (
        "object",
        lambda model: model[0].register_forward_hook(_CallCounter()),
        "self.calls",
        "self.calls += 1",
    ),
    (
        "closure",
        lambda model: model[2].register_forward_hook(_closure_hook()),
        "seen",
        "seen += 1",
    ),
    (
        "parameter",
        lambda model: model[0].weight.register_post_accumulate_grad_hook(_tensor_hook()),
        "norms",
        "norms.append(parameter.grad.norm())",
    ),
]


@pytest.mark.parametrize("case", HOOKS, ids=[c[0] for c in HOOKS])
def test_a_counter_in_a_hook_on_the_model_is_refused_at_its_line(batches, case) -> None:
    _, register, path, source = case
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    register(model)
    captured = _captured_sgd(model)
    for x, y in batches(14):
        captured(x, y)
    assert captured.state is StepState.EAGER and captured.stats.replays == 0
    reason = captured.reason
    assert reason is not None and reason.code is Code.FROZEN_PYTHON_VALUE, reason
    assert f"the step changes `{path}`" in reason.happened, reason.happened
    assert reason.location is not None and reason.location.source == source, reason.location


class _Smoothed(nn.Module):
    """A model of the user's that keeps a running mean of its outputs in a buffer, rebound
    on every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.register_buffer("mean_out", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        self.mean_out = self.mean_out * 0.9 + out.detach().mean(0) * 0.1
        return out


class _Recurrent(nn.Module):
    """A recurrent model of the user's that carries its state from call to call in an
    attribute (truncated backpropagation through time)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell, self.head = nn.Linear(16 + 8, 8), nn.Linear(8, 4)
        self.state = torch.zeros(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.cell(torch.cat([x, self.state], 1)))
        self.state = h.detach()
        return self.head(h)


# (the model, what the finding names, the source of the line it names)
REBOUND_IN_FORWARD = [
    (_Smoothed, ".mean_out`", "self.mean_out = self.mean_out * 0.9 + out.detach().mean(0) * 0.1"),
    (_Recurrent, ".state`", "h = torch.tanh(self.cell(torch.cat([x, self.state], 1)))"),
]


@pytest.mark.parametrize("case", REBOUND_IN_FORWARD, ids=["buffer", "recurrent_state"])
def test_a_tensor_the_users_module_rebinds_in_its_forward_is_refused(batches, case) -> None:
    build, named, source = case
    torch.manual_seed(0)
    captured = _captured_sgd(build())
    for x, y in batches(14):  # 8 samples each, as the recurrent state
        captured(x, y)
    reason = captured.reason
    assert reason is not None and reason.code is Code.FROZEN_PYTHON_VALUE, reason
    assert "a tensor outside it that it reads" in reason.happened and named in reason.happened
    assert reason.location is not None and reason.location.source == source, reason.location
