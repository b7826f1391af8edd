"""Generators and the scaler handed to `capture_step`: registered with the graph, and put
back after a recording that ran the step (the stand-in) or failed."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ddpgraph
from ddpgraph.backends import rng
from ddpgraph.training.scaler import GraphSafeGradScaler


def _noisy_run(
    make_run: Any, noise: torch.Generator, scaler: GraphSafeGradScaler | None = None
) -> Any:
    """A run whose step adds noise drawn from `noise` and, with `scaler`, scales the loss."""
    run = make_run(graph_safe=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        run.optimizer.zero_grad(set_to_none=True)
        x = x + 0.1 * torch.randn(x.shape, generator=noise)
        loss = F.cross_entropy(run.model(x), y)
        if scaler is None:
            loss.backward()
            run.optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(run.optimizer)
            scaler.update()
        return loss.detach()

    run.step = step
    return run


def test_registered_generator_follows_eager_training(
    make_run: Any, batches: Any, same: Any
) -> None:
    data = batches(16)
    ref = _noisy_run(make_run, torch.Generator().manual_seed(5))
    ref_trace = ref.train(data)
    noise = torch.Generator().manual_seed(5)
    run = _noisy_run(make_run, noise)
    trace = run.train(data, run.capture(generators=[noise]))
    assert trace.states[-1] == "captured"
    assert trace.losses == ref_trace.losses
    assert same(run.params(), ref.params())


def test_unregistered_generator_is_drawn_from_twice_by_the_stand_in(
    make_run: Any, batches: Any
) -> None:
    """Why `generators=` exists on CPU too: the stand-in's recording runs the step."""
    data = batches(14)
    ref_trace = _noisy_run(make_run, torch.Generator().manual_seed(5)).train(data)
    run = _noisy_run(make_run, torch.Generator().manual_seed(5))
    trace = run.train(data, run.capture())
    assert trace.losses[:11] == ref_trace.losses[:11]  # warm-up
    assert trace.losses[11:] != ref_trace.losses[11:]


def test_scaler_is_put_back_after_a_failed_recording(
    make_run: Any, batches: Any, same: Any
) -> None:
    data = batches(16)
    ref_scaler = GraphSafeGradScaler(init_scale=2.0**6, growth_interval=2)
    ref = _noisy_run(make_run, torch.Generator().manual_seed(5), ref_scaler)
    ref_trace = ref.train(data)
    scaler = GraphSafeGradScaler(init_scale=2.0**6, growth_interval=2)
    noise = torch.Generator().manual_seed(5)
    run = _noisy_run(make_run, noise, scaler)
    backend = ddpgraph.PassThroughBackend(fail_ranks={0})
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        step = run.capture(backend=backend, scaler=scaler, generators=[noise])
        trace = run.train(data, step)
    assert step.state is ddpgraph.StepState.EAGER and backend.captures == 1
    assert trace.losses == ref_trace.losses
    assert scaler.read() == ref_scaler.read()
    assert same(run.params(), ref.params())


def test_generators_are_checked(make_run: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ddpgraph.DdpGraphUsageError, match=r"expected torch\.Generator"):
        make_run().capture(generators=["seed"])
    cpu = [torch.Generator()]
    device = torch.device("cuda", 0)
    assert rng.generators_refusal(cpu, torch.device("cpu"), cuda_graphs=False) is None
    monkeypatch.setattr(rng, "REGISTERS_LAZILY", False)
    monkeypatch.delattr(torch.cuda.CUDAGraph, "register_generator_state", raising=False)
    old = rng.generators_refusal(cpu, device, cuda_graphs=True)
    assert old is not None and old.code is ddpgraph.Code.TORCH_TOO_OLD
    assert "register_generator_state" in old.happened and "default generator" in old.hint
    assert rng.generators_refusal([], device, cuda_graphs=True) is None
    monkeypatch.setattr(
        torch.cuda.CUDAGraph, "register_generator_state", lambda self, g: None, raising=False
    )
    with pytest.raises(
        ddpgraph.DdpGraphUsageError, match=re.escape("torch.Generator(device='cuda:0')")
    ):
        rng.generators_refusal(cpu, device, cuda_graphs=True)


class _FakeGraph:
    def __init__(self) -> None:
        self.registered: list[torch.Generator] = []

    def register_generator_state(self, g: torch.Generator) -> None:
        self.registered.append(g)


@pytest.mark.parametrize(
    ("version", "lazily"),
    [("2.11.0+cu130", False), ("2.4.1", False), ("2.14.0a0+4fdf77b", True), ("3.0", True)],
)
def test_registration_is_explicit_before_2_14(
    version: str, lazily: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch, "__version__", version)
    assert (rng._version() >= (2, 14)) is lazily
    monkeypatch.setattr(rng, "REGISTERS_LAZILY", lazily)
    graph, g = _FakeGraph(), torch.Generator()
    rng.register_generators(graph, [g])  # type: ignore[arg-type]
    assert graph.registered == ([] if lazily else [g])


def test_keep_states_restores_generators() -> None:
    g = torch.Generator().manual_seed(3)
    restore = rng.keep_states([g])
    first = torch.rand(4, generator=g)
    restore()
    assert torch.equal(torch.rand(4, generator=g), first)
