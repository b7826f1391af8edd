"""`capture_step(..., compile=True)`: the compile strategy's step behind one keyword.

On CPU, TorchDynamo's eager backend (no code generation) stands in for inductor, and
the stand-in graph backend for CUDA graphs, as in test_strategies_compile.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddpgraph
from ddpgraph import Code, DdpGraphUsageError, StepState
from ddpgraph.app.reference_step import StepOptions, make_train_step
from ddpgraph.strategies import CompiledStep, compile_switch
from ddpgraph.strategies.dynamo import CompileSpec, compile_count

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:torch")


@pytest.fixture
def eager_compile(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The switch compiles with Dynamo's eager backend, from Dynamo's initial state."""
    torch._dynamo.reset()
    monkeypatch.setattr(compile_switch, "SPEC", CompileSpec(backend="eager"))
    yield
    torch._dynamo.reset()


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    ddp = ddpgraph.prepare_ddp(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    return ddp, opt, make_train_step(ddp, opt, F.cross_entropy, StepOptions(None, None))


def test_compile_true_is_the_compile_strategy_and_captures(
    process_group: Any, batches: Any, eager_compile: None
) -> None:
    ddp, opt, fn = _setup()
    backend = ddpgraph.PassThroughBackend()
    step = ddpgraph.capture_step(fn, model=ddp, optimizer=opt, backend=backend, compile=True)
    assert isinstance(step, CompiledStep) and step.strategy == "compile"
    assert ddp._compiled_call_impl is not None  # compiled in place: `fn` is unchanged
    data = batches(16)
    for x, y in data[:12]:
        step(x, y)
    assert step.state is StepState.CAPTURED and step.reason is None
    compiled = compile_count()
    for x, y in data[12:]:
        step(x, y)
    assert step.stats.replays > 0 and compile_count() == compiled
    assert backend.captures == 1  # capture_step's other arguments reach the strategy
    step.close()
    assert ddp._compiled_call_impl is None  # the user's model is theirs again


def test_compile_true_on_cpu_without_a_graph_backend_runs_eagerly(
    process_group: Any, batches: Any, eager_compile: None
) -> None:
    ddp, opt, fn = _setup()
    step = ddpgraph.capture_step(fn, model=ddp, optimizer=opt, compile=True)
    x, y = batches(1)[0]
    assert torch.isfinite(step(x, y))
    assert step.state is StepState.EAGER and step.reason is not None
    assert step.reason.code is Code.NO_CUDA
    assert ddp._compiled_call_impl is None  # nothing to capture: not compiled either


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_compile_must_be_a_bool(process_group: Any, value: Any) -> None:
    ddp, opt, fn = _setup()
    with pytest.raises(DdpGraphUsageError) as info:
        ddpgraph.capture_step(fn, model=ddp, optimizer=opt, compile=value)
    assert "`capture_step(compile=...)`" in str(info.value) and repr(value) in str(info.value)
    assert ddp._compiled_call_impl is None


def test_the_other_arguments_are_checked_first(process_group: Any) -> None:
    ddp, _, fn = _setup()
    with pytest.raises(DdpGraphUsageError, match=r"capture_step\(optimizer=\.\.\.\)"):
        ddpgraph.capture_step(fn, model=ddp, optimizer="adam", compile=True)  # type: ignore[arg-type]


def test_capture_step_calls_the_compile_strategys_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    def builder(fn: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        raise _Built

    monkeypatch.setattr(compile_switch, "capture_compiled", builder)
    ddp, opt, fn = _setup()
    with pytest.raises(_Built):
        ddpgraph.capture_step(fn, model=ddp, optimizer=opt, compile=True, warmup_steps=3)
    [kwargs] = seen
    assert kwargs["compile"] is True and kwargs["model"] is ddp and kwargs["optimizers"] is opt
    assert kwargs["options"] == ddpgraph.CaptureOptions(warmup_steps=3)


class _Built(Exception):
    pass
