"""The CPU recording backend has a CUDA graph's semantics: a replay runs no Python,
Python numbers are frozen at recording, recording itself computes nothing, replays
write into the recorded tensors, random numbers are fresh per replay, and a host read
while recording fails the capture with the user's line."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddpgraph
from ddpgraph import Code, StepState
from ddpgraph.backends.graph import CaptureError
from ddpgraph.backends.recording import RecordingBackend
from ddpgraph.probe.diagnose import finding_from_capture_error
from ddpgraph.probe.host_reads import HostReadInCapture


def _linear_step(lr: float = 0.1):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return model, opt, step


def test_replays_equal_eager_ddp_training_bit_for_bit(make_run, batches, same) -> None:
    # DDP over the one-process gloo group, batch norm (buffers), dropout (RNG), fused
    # AdamW with the learning rate in a tensor that the schedule changes every step.
    data = batches(16)
    ref = make_run(graph_safe=True, fused=True)
    expected = ref.train(data)
    run = make_run(fused=True)
    backend = RecordingBackend()
    step = run.capture(backend=backend)
    got = run.train(data, step)
    assert got.states == ["warmup"] * 11 + ["captured"] * 5
    assert step.stats.replays == 5 and step.reason is None
    assert got.losses == expected.losses
    assert same(run.params(), ref.params()) and same(run.buffers(), ref.buffers())
    assert backend.last is not None and "c10d.allreduce_.default" in backend.last.collectives


@pytest.mark.filterwarnings("ignore::FutureWarning")  # `broadcast_buffers` is being renamed
@pytest.mark.parametrize(
    "ddp_kw",
    [
        {"find_unused_parameters": True},  # the reducer reads its used-parameter map on the host
        {"static_graph": True},
        {"gradient_as_bucket_view": True},
        {"broadcast_buffers": False},  # batch norm's running stats: written but not declared so
        None,  # no DDP at all
    ],
    ids=[
        "find_unused_parameters",
        "static_graph",
        "gradient_as_bucket_view",
        "no_buffer_broadcast",
        "no_ddp",
    ],
)
def test_ddp_options_that_capture_on_a_gpu_replay_like_eager(
    make_run, ddp_kw, batches, same
) -> None:
    def build(graph_safe: bool = False):  # type: ignore[no-untyped-def]
        kw = {"optimizer": torch.optim.SGD, "lr": 0.05, "momentum": 0.9, "fused": True}
        return make_run(ddp=ddp_kw is not None, ddp_kw=ddp_kw, graph_safe=graph_safe, **kw)

    data = batches(15)
    ref = build(graph_safe=True)
    expected = ref.train(data)
    run = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DDP's find_unused_parameters advice
        got = run.train(data, run.capture(backend=RecordingBackend()))
    assert got.states[-1] == "captured", got.states
    assert got.losses == expected.losses
    assert same(run.params(), ref.params()) and same(run.buffers(), ref.buffers())


def test_a_float_learning_rate_is_frozen_in_replays() -> None:
    """What GPUs do to a float lr changed after capture (what every scheduler does): the
    replay keeps the value it was recorded with. The stand-in cannot show it."""
    model, opt, step = _linear_step(lr=0.1)
    graph = RecordingBackend().capture(step, stream=None, pool=None)
    before = model.weight.detach().clone()
    graph.replay()
    recorded_update = model.weight.detach() - before
    opt.param_groups[0]["lr"] = 0.0
    before = model.weight.detach().clone()
    graph.replay()
    assert torch.allclose(model.weight.detach() - before, recorded_update, rtol=0.2)
    assert recorded_update.abs().max() > 0

    model, opt, step = _linear_step(lr=0.1)
    stand_in = ddpgraph.PassThroughBackend().capture(step, stream=None, pool=None)
    opt.param_groups[0]["lr"] = 0.0
    before = model.weight.detach().clone()
    stand_in.replay()
    assert torch.equal(model.weight.detach(), before)  # the stand-in re-reads the lr


def test_loss_item_inside_the_step_is_host_sync_with_its_line(make_run, batches, same) -> None:
    data = batches(8)
    ref = make_run(ddp=False, graph_safe=True, fused=True)
    expected = ref.train(data)
    run = make_run(ddp=False, fused=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = run.step(x, y)
        print(loss.item(), end="\r")  # the host read
        return loss

    line = step.__code__.co_firstlineno + 2
    captured = ddpgraph.capture_step(
        step, model=run.model, optimizer=run.optimizer, backend=RecordingBackend()
    )
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got = run.train(data, captured)
    assert captured.state is StepState.EAGER
    reason = captured.reason
    assert reason is not None and reason.code is Code.HOST_SYNC_IN_CAPTURE, reason
    assert reason.location is not None and reason.location.lineno == line
    assert reason.location.filename == __file__ and "loss.item()" in reason.location.source
    # the failed capture lost no step and applied none twice
    assert got.losses == expected.losses and same(run.params(), ref.params())


def _host_reads() -> dict[str, object]:
    def mask(t: torch.Tensor) -> object:
        return t[t > 0]

    def branch(t: torch.Tensor) -> object:
        return 1 if t.sum() > 0 else 0

    return {
        "item": lambda t: t.sum().item(),
        "float": lambda t: float(t.sum()),
        "if": branch,
        "tolist": lambda t: t.tolist(),
        "print": lambda t: repr(t),
        "f-string": lambda t: f"{t.sum():.3f}",
        "nonzero": lambda t: torch.nonzero(t),
        "mask": mask,
        "cpu": lambda t: t.cpu(),
        "numpy": lambda t: t.detach().numpy(),
        "unique": lambda t: torch.unique(t),
    }


@pytest.mark.parametrize("name", list(_host_reads()))
def test_every_host_read_fails_the_recording_as_cuda_would(name: str) -> None:
    read = _host_reads()[name]
    t = torch.randn(6)
    with pytest.raises(CaptureError) as info:
        RecordingBackend().capture(lambda: read(t * 2), stream=None, pool=None)
    assert isinstance(info.value.cause, HostReadInCapture)
    assert "operation not permitted when stream is capturing" in str(info.value.cause)
    finding = finding_from_capture_error(info.value)
    assert finding.code is Code.HOST_SYNC_IN_CAPTURE
    assert finding.location is not None and finding.location.filename == __file__


def _assign_scalar_through_a_mask(t: torch.Tensor) -> torch.Tensor:
    y = t.clone()
    y[y > 0] = 0.0  # PyTorch runs it as masked_fill_: nothing read on the host
    return y


def _accumulate_through_a_mask(t: torch.Tensor) -> torch.Tensor:
    y = t.clone()
    # Accumulating has no masked_fill_ path: the mask's nonzero is computed, a host read.
    return y.index_put_((y > 0,), torch.tensor(1.0), accumulate=True)


def test_a_scalar_assigned_through_a_mask_records_as_cuda_records_it() -> None:
    # Measured on an H200 (scripts/probes/cpu_emulation_fidelity.py): CUDA captures
    # `y[mask] = 0.0`; accumulating through a mask is refused by both.
    t = torch.randn(6)
    graph = RecordingBackend().capture(
        lambda: _assign_scalar_through_a_mask(t), stream=None, pool=None
    )
    graph.replay()
    assert torch.equal(graph.outputs, t.clamp(max=0))
    with pytest.raises(CaptureError):
        RecordingBackend().capture(lambda: _accumulate_through_a_mask(t), stream=None, pool=None)


def test_a_cpu_optimizer_that_reads_its_step_count_is_not_capturable(make_run, batches) -> None:
    # RMSprop on CPU reads the step count with `.item()` (no capturable or fused CPU
    # kernel): a replay would repeat one step size, so the step is refused before any
    # call, with what works on CPU (Adam, AdamW and SGD run their fused kernels).
    run = make_run(ddp=False, optimizer=torch.optim.RMSprop)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        step = run.capture(backend=RecordingBackend())
        got = run.train(batches(5), step)
    assert got.states == ["eager"] * 5
    reason = step.reason
    assert reason is not None and reason.code is Code.OPTIMIZER_NOT_CAPTURABLE, reason
    assert "on CPU, RMSprop's step reads a value on the host" in reason.happened
    assert "Adam, AdamW or SGD" in reason.hint


def test_recording_computes_nothing_and_created_tensors_wait_for_the_first_replay() -> None:
    model, _, step = _linear_step()
    step()
    weight, rng = model.weight.detach().clone(), torch.get_rng_state()
    graph = RecordingBackend().capture(step, stream=None, pool=None)
    assert torch.equal(model.weight.detach(), weight)
    assert torch.equal(torch.get_rng_state(), rng)
    # set_to_none inside the step: the grads are new tensors, graph memory until a replay
    assert model.weight.grad is not None and torch.isnan(model.weight.grad).all()
    assert torch.isnan(graph.outputs)
    graph.replay()
    assert not torch.isnan(graph.outputs) and not torch.equal(model.weight.detach(), weight)
    assert not torch.isnan(model.weight.grad).any()


def test_replays_write_into_the_recorded_tensors() -> None:
    model, _, step = _linear_step()
    graph = RecordingBackend().capture(step, stream=None, pool=None)
    out, grad = graph.outputs, model.weight.grad
    pointers = (out.data_ptr(), grad.data_ptr())
    losses = []
    for _ in range(3):
        graph.replay()
        losses.append(float(out))
        assert graph.outputs is out and model.weight.grad is grad
        assert (out.data_ptr(), grad.data_ptr()) == pointers
    assert losses[0] > losses[1] > losses[2]  # training goes on: the same tensors, new values


def test_in_place_ops_and_views_replay_on_the_same_storage() -> None:
    total = torch.zeros(3)
    x = torch.ones(6)

    def step() -> torch.Tensor:
        view = total.view(3, 1).squeeze(1)
        view.add_(x.view(2, 3).sum(0))  # in place through a view of a tensor made before
        return total[1:]  # an output aliasing it

    graph = RecordingBackend().capture(step, stream=None, pool=None)
    assert torch.equal(total, torch.zeros(3))  # recording computed nothing
    graph.replay()
    graph.replay()
    assert torch.equal(total, torch.full((3,), 4.0))
    assert graph.outputs.data_ptr() == total[1:].data_ptr()
    assert torch.equal(graph.outputs, torch.full((2,), 4.0))


def test_random_numbers_are_fresh_per_replay_and_follow_the_seed() -> None:
    x = torch.ones(64)
    gen = torch.Generator().manual_seed(3)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        return F.dropout(x, 0.5, training=True), torch.rand(4, generator=gen)

    torch.manual_seed(7)
    eager = [tuple(t.clone() for t in step()) for _ in range(3)]
    torch.manual_seed(7)
    gen.manual_seed(3)
    graph = RecordingBackend().capture(step, stream=None, pool=None, generators=[gen])
    replays = []
    for _ in range(3):
        graph.replay()
        replays.append(tuple(t.clone() for t in graph.outputs))
    for (e_mask, e_rand), (r_mask, r_rand) in zip(eager, replays, strict=True):
        assert torch.equal(e_mask, r_mask) and torch.equal(e_rand, r_rand)
    assert not torch.equal(replays[0][0], replays[1][0])


def test_injected_failure_and_capturing_flag() -> None:
    backend = RecordingBackend(fail_ranks={0}, message="injected")
    flags: list[bool] = []
    with pytest.raises(CaptureError, match="injected"):
        backend.capture(lambda: flags.append(backend.capturing), stream=None, pool=None)
    assert flags == [True] and backend.capturing is False
