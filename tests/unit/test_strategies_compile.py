"""`strategy="compile"` on CPU: TorchDynamo with the eager backend (no code
generation, so compiling takes a second) and the stand-in graph backend. Checks the
meeting points of compiling and capturing: warm-up, no compile inside a capture,
restarts, and what replays cannot see."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddpgraph
from ddpgraph import Code, StepState
from ddpgraph.ddp.build import forward_counter
from ddpgraph.strategies import CompiledStep, make_step
from ddpgraph.strategies.dynamo import FUSION_MODES, CompileSpec, compile_count, fusion_spec

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:torch")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Flagged(nn.Module):
    """Reads a Python attribute in forward: Dynamo guards on it, so changing it makes
    Dynamo recompile, while the result stays the same."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.b = nn.Linear(32, 4)
        self.flag = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.bn(self.a(x)))
        if self.flag:
            h = h + 0.0
        return self.b(h)


def _setup(compiled_reference: bool = False) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    ddp = ddpgraph.prepare_ddp(Flagged())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    if compiled_reference:
        ddpgraph.graph_safe_optimizer(opt, tensor_lr_on_cpu=True)
        ddp.compile(backend="eager")
    return ddp, opt, step


def _train(step: Any, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    return [float(step(x, y)) for x, y in data]


def _compiled_step(
    ddp: nn.Module, opt: torch.optim.Optimizer, fn: Any, **kw: Any
) -> CompiledStep[Any]:
    step = make_step(
        fn,
        model=ddp,
        optimizer=opt,
        strategy="compile",
        compile_backend="eager",
        backend=ddpgraph.PassThroughBackend(),
        **kw,
    )
    assert isinstance(step, CompiledStep)
    return step


def test_compiled_model_captured_trains_like_compiled_eager(process_group, batches, same) -> None:
    data = batches(16)
    ref_ddp, _, ref_fn = _setup(compiled_reference=True)
    ref_losses = _train(ref_fn, data)
    torch._dynamo.reset()
    ddp, opt, fn = _setup()
    step = _compiled_step(ddp, opt, fn)
    assert ddp._compiled_call_impl is not None  # compiled in place: `fn` is unchanged
    losses = _train(step, data[:12])
    assert step.state is StepState.CAPTURED and step.restarts == 0
    assert step.stats.warmup_steps == 11 and step.stats.captures == 1
    # The DDP forward counter still counts through the compiled call.
    counter = forward_counter(ddp)
    assert counter is not None and counter.count >= 12
    compiled = compile_count()
    losses += _train(step, data[12:])
    assert compile_count() == compiled  # replays compile nothing
    assert losses == ref_losses
    assert same([p.detach() for p in ddp.parameters()], [p.detach() for p in ref_ddp.parameters()])
    step.close()
    assert ddp._compiled_call_impl is None and step.state is StepState.CLOSED


def test_a_compile_during_capture_discards_it_and_captures_again(
    process_group, batches, same
) -> None:
    data = batches(20)
    ref_ddp, _, ref_fn = _setup(compiled_reference=True)
    ref_losses = _train(ref_fn, data)
    torch._dynamo.reset()
    ddp, opt, fn = _setup()
    backend = ddpgraph.PassThroughBackend()
    recordings = []

    def flipping(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # The first recording sees another flag value: Dynamo recompiles inside it.
        ddp.module.flag = backend.capturing and not recordings
        if backend.capturing:
            recordings.append(len(recordings))
        return fn(x, y)

    step = make_step(
        flipping,
        model=ddp,
        optimizer=opt,
        strategy="compile",
        compile_backend="eager",
        backend=backend,
    )
    assert isinstance(step, CompiledStep)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _train(step, data)
    assert step.restarts == 1 and step.state is StepState.CAPTURED and step.reason is None
    assert recordings == [0, 1] and step.stats.captures == 1 and backend.captures == 1
    assert "state=captured" in repr(step)
    assert any("compiled while the step was being captured" in str(w.message) for w in caught)
    assert losses == ref_losses
    assert same([p.detach() for p in ddp.parameters()], [p.detach() for p in ref_ddp.parameters()])


def test_capture_waits_until_a_call_compiles_nothing(process_group, batches) -> None:
    ddp, opt, fn = _setup()
    data = batches(12)
    _train(fn, data[:6])  # DDP is past its sampled iterations: the default warm-up is 1 call
    _train(fn, data[:6])
    calls = []

    def late_flip(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(compile_count())
        ddp.module.flag = len(calls) == 3  # makes the third call recompile
        return fn(x, y)

    step = make_step(
        late_flip,
        model=ddp,
        optimizer=opt,
        strategy="compile",
        compile_backend="eager",
        backend=ddpgraph.PassThroughBackend(),
    )
    states = []
    for x, y in data[:8]:
        step(x, y)
        states.append(step.state.value)
    # Call 1 compiles, call 2 is quiet, call 3 (the probe) recompiles: settle again with
    # calls 4 and 5 (quiet), probe on call 6, capture on call 7.
    assert states == ["warmup"] * 6 + ["captured"] * 2
    assert step.restarts == 1 and step.stats.warmup_steps == 6  # type: ignore[attr-defined]


def test_a_submodule_switched_to_eval_after_capture_runs_eagerly(process_group, batches) -> None:
    ddp, opt, fn = _setup()
    step = _compiled_step(ddp, opt, fn)
    data = batches(16)
    _train(step, data[:12])
    assert step.state is StepState.CAPTURED
    ddp.module.bn.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(step, data[12:14])
    assert step.stats.input_changes == 2 and step.stats.eager_steps == 2
    messages = [str(w.message) for w in caught if issubclass(w.category, ddpgraph.DdpGraphWarning)]
    assert (
        len(messages) == 1 and "MODEL_MODE_CHANGED" in messages[0] and "BatchNorm1d" in messages[0]
    )
    ddp.module.bn.train()
    replays = step.stats.replays
    _train(step, data[14:])
    assert step.stats.replays == replays + 2


def test_the_eval_mode_is_the_reason_the_calls_ran_eagerly(process_group, batches) -> None:
    # A call that runs eagerly while the graph stays is counted and says why: a bench row
    # or a training loop whose every call runs eagerly must not pass for a slow graph.
    ddp, opt, fn = _setup()
    step = _compiled_step(ddp, opt, fn)
    data = batches(14)
    _train(step, data[:12])
    assert step.eager_reason is None
    ddp.module.bn.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(step, data[12:])
    assert step.state is StepState.CAPTURED and step.reason is None
    assert step.stats.eager_steps == 2
    assert step.eager_reason is not None and step.eager_reason.code is Code.MODEL_MODE_CHANGED


def test_warm_up_copies_keep_each_argument_where_it_is(process_group) -> None:
    # capture_step records the signature it is given: the warm-up copies the compile
    # strategy hands it (laid out as the static inputs will be) must keep the caller's
    # device, or a CPU batch (a pinned DataLoader's) would be recorded as a GPU input and
    # every later call with the user's CPU batch would differ from it and run eagerly.
    from ddpgraph.inputs.arguments import TensorMeta
    from ddpgraph.strategies.base import like_static_inputs

    x = torch.randn(8, 6)[:, :4]  # a slice: not contiguous
    y = torch.arange(8)
    (cx, cy), kw = like_static_inputs((x, y), {})
    assert kw == {}
    assert [TensorMeta.of(t) for t in (cx, cy)] == [TensorMeta.of(t) for t in (x, y)]
    assert cx.is_contiguous() and cx.data_ptr() != x.data_ptr() and torch.equal(cx, x)


def test_a_model_compiled_by_the_user(process_group, batches) -> None:
    ddp, opt, _ = _setup()
    compiled = torch.compile(ddp, backend="eager")

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(compiled(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    step = make_step(
        fn, model=compiled, optimizer=opt, strategy="whole", backend=ddpgraph.PassThroughBackend()
    )
    assert isinstance(step, CompiledStep) and step.compiled is None
    _train(step, batches(13))
    assert step.state is StepState.CAPTURED and step.stats.warmup_steps == 11
    # The watched warm-up steps run the user's wrapper outside the value watch: a mode on
    # the stack is one of Dynamo's guards, and would make it compile the model again.
    assert not [
        reason
        for reasons in torch._dynamo.utils.guard_failures.values()
        for reason in reasons
        if "torch_function_mode_stack" in str(reason)
    ]


def test_a_model_compiled_with_its_own_graphs_is_refused(process_group) -> None:
    ddp, opt, fn = _setup()
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="reduce-overhead"):
        make_step(
            fn, model=torch.compile(ddp, mode="reduce-overhead"), optimizer=opt, strategy="compile"
        )
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="expected the plain model"):
        make_step(fn, model=torch.compile(ddp, backend="eager"), optimizer=opt, strategy="partial")


def test_without_a_graph_backend_on_cpu_nothing_is_compiled(process_group, batches) -> None:
    ddp, opt, fn = _setup()
    step = make_step(fn, model=ddp, optimizer=opt, strategy="compile")
    assert ddp._compiled_call_impl is None
    assert (
        step.state is StepState.EAGER
        and step.reason is not None
        and step.reason.code is Code.NO_CUDA
    )
    ro = make_step(fn, model=ddp, optimizer=opt, strategy="reduce-overhead")
    _train(ro, batches(2))
    assert (
        ro.reason is not None and ro.reason.code is Code.NO_CUDA and ddp._compiled_call_impl is None
    )


def test_fusion_modes() -> None:
    assert fusion_spec(None, "inductor", "s").options() == {"backend": "inductor"}
    assert fusion_spec("default", "inductor", "s").options() == {"backend": "inductor"}
    spec = fusion_spec("max-autotune-no-cudagraphs", "inductor", "s")
    assert spec.options() == {"backend": "inductor", "mode": "max-autotune-no-cudagraphs"}
    assert CompileSpec("max-autotune-no-cudagraphs", "eager").options() == {"backend": "eager"}
    assert "max-autotune" not in FUSION_MODES
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="makes no CUDA graphs"):
        fusion_spec("max-autotune", "inductor", "`s`")
