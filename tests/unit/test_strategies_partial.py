"""Partial capture on CPU, with a stand-in grapher in place of
`torch.cuda.make_graphed_callables`: which submodules are chosen, what is left eager and
why, the guard around each graphed forward, and that training is unchanged."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import ddpgraph
from ddpgraph import Code, StepState
from ddpgraph.strategies import make_step, partial
from ddpgraph.strategies.partial import graph_submodules, partial_report, ungraph_submodules
from ddpgraph.strategies.partial_graphed import GraphedForward
from ddpgraph.strategies.partial_record import AutocastState


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    """Blocks in a ModuleList (a container never called itself), batch norm, and a
    layer applied twice per forward (which cannot be graphed)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(Block(32) for _ in range(3))
        self.bn = nn.BatchNorm1d(32)
        self.twice = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        h = self.twice(self.twice(self.bn(h)))
        return self.head(h)


class FakeGrapher:
    """Replaces `forward` by a wrapper, as make_graphed_callables does; fails (with the
    error a host sync inside a capture gives) or perturbs the named submodules."""

    def __init__(
        self, net: nn.Module, fail: tuple[str, ...] = (), perturb: tuple[str, ...] = ()
    ) -> None:
        modules = dict(net.named_modules())
        self.fail = {id(modules[n]) for n in fail}
        self.perturb = {id(modules[n]) for n in perturb}
        self.graphed: list[nn.Module] = []

    def __call__(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        assert all(isinstance(a, torch.Tensor) for a in args)
        if id(module) in self.fail:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        original = module.forward
        shift = 0.5 if id(module) in self.perturb else 0.0

        def graphed(*a: Any) -> Any:
            return original(*a) + shift

        module.forward = graphed  # type: ignore[method-assign]
        self.graphed.append(module)


@contextlib.contextmanager
def stand_in(grapher: Any) -> Iterator[None]:
    """`grapher` records submodules in place of CUDA graphs, also of a CPU model."""
    before = partial._STAND_IN_GRAPHER
    partial._STAND_IN_GRAPHER = grapher
    try:
        yield
    finally:
        partial._STAND_IN_GRAPHER = before


def _graph(model: nn.Module, *args: Any, grapher: Any, **kwargs: Any) -> nn.Module:
    with stand_in(grapher):
        return graph_submodules(model, *args, **kwargs)


def _x(n: int = 8) -> torch.Tensor:
    return torch.randn(n, 16, generator=torch.Generator().manual_seed(3))


def test_the_whole_model_is_graphed_when_it_can_be() -> None:
    net = Net()
    grapher = FakeGrapher(net)
    assert _graph(net, (_x(),), grapher=grapher) is net
    report = partial_report(net)
    assert report is not None and report.graphed == [""] and report.skipped == []
    assert grapher.graphed == [net]
    assert "the whole model" in report.format()


def test_a_module_that_fails_is_replaced_by_its_children() -> None:
    net = Net()
    _graph(net, (_x(),), grapher=FakeGrapher(net, fail=("",)))
    report = partial_report(net)
    assert report is not None
    assert report.graphed == ["inp", "bn", "head", "blocks.0", "blocks.1", "blocks.2"]
    skipped = {s.name: s for s in report.skipped}
    assert set(skipped) == {"", "twice"}
    assert skipped[""].finding is not None and skipped[""].finding.code is Code.HOST_SYNC_IN_CAPTURE
    assert "called 2 times per forward" in skipped["twice"].why
    assert "left eager: `twice`" in report.format()


def test_a_module_unlike_eager_is_rejected() -> None:
    net = Net()
    _graph(net, (_x(),), grapher=FakeGrapher(net, perturb=("", "blocks.1")))
    report = partial_report(net)
    assert report is not None and "blocks.1" not in report.graphed and "blocks.0" in report.graphed
    rejected = {s.name: s for s in report.skipped}
    finding = rejected["blocks.1"].finding
    assert finding is not None and finding.code is Code.CAPTURE_FAILED
    assert "differ from eager" in finding.happened
    assert "blocks.1" not in [n for n, m in net.named_modules() if "forward" in m.__dict__]


def test_named_submodules_only() -> None:
    net = Net()
    _graph(net, (_x(),), names=["blocks.1", "head"], grapher=FakeGrapher(net))
    report = partial_report(net)
    assert report is not None and report.graphed == ["blocks.1", "head"]


def test_a_named_submodule_that_cannot_be_graphed_raises() -> None:
    net = Net()
    with pytest.raises(ddpgraph.DdpGraphError) as err:
        _graph(net, (_x(),), names=["head", "twice"], grapher=FakeGrapher(net))
    assert "called 2 times" in str(err.value)
    assert partial_report(net) is None and "forward" not in net.head.__dict__  # nothing kept
    with pytest.raises(ddpgraph.DdpGraphError) as err:
        _graph(net, (_x(),), names=["blocks.0"], grapher=FakeGrapher(net, fail=("blocks.0",)))
    assert err.value.code is Code.HOST_SYNC_IN_CAPTURE


def test_graphing_leaves_buffers_and_rng_as_they_were(same) -> None:
    net = Net()
    buffers = [b.clone() for b in net.buffers()]
    params = [p.detach().clone() for p in net.parameters()]
    rng = torch.get_rng_state()
    _graph(net, (_x(),), grapher=FakeGrapher(net, fail=("",)))
    assert same([b.clone() for b in net.buffers()], buffers)
    assert same([p.detach().clone() for p in net.parameters()], params)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in net.parameters())


def test_calls_unlike_the_sample_run_the_original_forward() -> None:
    net = Net()
    _graph(net, (_x(),), grapher=FakeGrapher(net, fail=("",)))
    head = net.head.forward
    assert isinstance(head, GraphedForward)
    net(_x())
    assert head.replays == 1 and head.fallbacks == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net(_x(5))  # an odd batch
        net(_x(5))
    assert head.fallbacks == 2 and head.replays == 1
    messages = [str(w.message) for w in caught if issubclass(w.category, ddpgraph.DdpGraphWarning)]
    assert any("graphed submodule `head`" in m and "(5, 32)" in m for m in messages)
    assert sum("`head`" in m for m in messages) == 1  # warned once per submodule
    net.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net(_x())  # eval mode: the original forward, silently
    assert head.replays == 1
    first = net.inp.forward
    assert isinstance(first, GraphedForward)
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings(record=True):
        net.train()
        warnings.simplefilter("always")
        net(_x())
    assert "autocast changed" in first.last_fallback
    assert "bfloat16" in head.last_fallback  # its input, made under autocast, changed dtype


def test_a_gradient_kept_from_the_graph_gets_its_own_memory() -> None:
    lin = nn.Linear(4, 4)
    lin.weight.grad = torch.ones(4, 4)
    forward = GraphedForward(
        "lin",
        lin,
        lin.forward,
        ddpgraph.inputs.arguments.Signature(
            [torch.zeros(2, 4)],
            ddpgraph.inputs.arguments.flatten_call((torch.zeros(2, 4),), {})[1],
            ["args[0]"],
        ),
        AutocastState.current("cpu"),
        [(lin.weight, lin.weight.grad.data_ptr())],
    )
    kept = lin.weight.grad
    forward(torch.zeros(2, 4))
    assert lin.weight.grad is not kept and torch.equal(lin.weight.grad, kept)


def test_ungraph_puts_the_original_forwards_back() -> None:
    net = Net()
    _graph(net, (_x(),), grapher=FakeGrapher(net, fail=("",)))
    ungraph_submodules(net)
    assert partial_report(net) is None
    assert not any("forward" in m.__dict__ for m in net.modules())


def test_graph_submodules_usage_errors() -> None:
    net = Net()
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="CUDA device"):
        graph_submodules(net, (_x(),))
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="'nope'"):
        _graph(net, (_x(),), names=["nope"], grapher=FakeGrapher(net))
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="tuple"):
        _graph(net, _x(), grapher=FakeGrapher(net))
    _graph(net, (_x(),), grapher=FakeGrapher(net))
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="already graphed"):
        _graph(net, (_x(),), grapher=FakeGrapher(net))


def test_partial_strategy_trains_like_eager(make_run, batches, same) -> None:
    data = batches(12)
    ref = make_run()
    ref_trace = ref.train(data)
    run = make_run()
    grapher = FakeGrapher(run.model.module)
    with stand_in(grapher):
        step = make_step(run.step, model=run.model, optimizer=run.optimizer, strategy="partial")
    assert step.state is StepState.WARMUP
    trace = run.train(data, step)
    assert trace.states == ["captured"] * 12
    assert step.stats.warmup_steps == 1 and step.stats.replays == 11 and step.stats.captures == 1
    assert grapher.graphed == [run.model.module]
    assert trace.losses == ref_trace.losses and same(run.params(), ref.params())
    with step.reference():  # type: ignore[attr-defined]
        forward = run.model.module.forward
        assert isinstance(forward, GraphedForward) and forward.bypass
    step.close()
    assert "forward" not in run.model.module.__dict__


def test_partial_strategy_uses_submodules_graphed_before(make_run) -> None:
    run = make_run()
    _graph(run.model, (_x(),), grapher=FakeGrapher(run.model.module))
    step = make_step(run.step, model=run.model, optimizer=run.optimizer, strategy="partial")
    assert step.state is StepState.CAPTURED and step.stats.captures == 1


def test_partial_strategy_without_cuda_runs_eagerly(make_run, batches) -> None:
    run = make_run()
    step = make_step(run.step, model=run.model, optimizer=run.optimizer, strategy="partial")
    assert step.state is StepState.EAGER
    assert step.reason is not None and step.reason.code is Code.NO_CUDA
    run.train(batches(2), step)
    assert step.stats.eager_steps == 2
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="'nope'"):
        make_step(run.step, model=run.model, strategy="partial", graph_modules=["nope"])


def test_nothing_graphable_is_explained(make_run, batches) -> None:
    run = make_run()
    net = run.model.module
    names = [n for n, m in net.named_modules() if any(True for _ in m.parameters())]
    with stand_in(FakeGrapher(net, fail=tuple(names))):
        step = make_step(run.step, model=run.model, strategy="partial")
    run.train(batches(2), step)
    assert step.state is StepState.EAGER
    assert step.reason is not None and "no submodule could be graphed" in step.reason.happened
