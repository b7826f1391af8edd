"""`capture_step` from warm-up to replays on CPU, with the stand-in graph backend.

The stand-in records by running the step and replays by running it again on the static
inputs; `capture_step` must undo the recorded run, so captured training equals an eager
loop of the same graph-safe optimizer bit for bit.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import ddpgraph
from ddpgraph import StepState
from ddpgraph.ddp.build import forward_counter


def test_default_warmup_is_11_calls_then_captured(make_run, batches) -> None:
    run = make_run()
    backend = ddpgraph.PassThroughBackend()
    step = run.capture(backend=backend)
    assert step.state is StepState.WARMUP and step.reason is None
    trace = run.train(batches(15), step)
    assert trace.states == ["warmup"] * 11 + ["captured"] * 4
    s = step.stats
    assert (s.calls, s.warmup_steps, s.captures, s.replays, s.eager_steps) == (15, 11, 1, 4, 0)
    assert s.capture_seconds is not None and s.capture_seconds >= 0
    assert backend.captures == 1
    assert step.reason is None and step.findings == []
    assert step.backend_name == "pass-through"
    assert "captured" in repr(step)


def test_replays_keep_counting(make_run, batches) -> None:
    run = make_run()
    step = run.capture()
    replays = []
    for x, y in batches(16):
        step(x, y)
        replays.append(step.stats.replays)
    assert replays == [0] * 11 + [1, 2, 3, 4, 5]


def test_explicit_warmup_steps(make_run, batches) -> None:
    run = make_run()
    step = run.capture(warmup_steps=14)
    assert run.train(batches(16), step).states == ["warmup"] * 14 + ["captured"] * 2


@pytest.mark.parametrize("schedule", ["lambda", "cosine"])
def test_captured_training_equals_eager_bit_for_bit(make_run, batches, same, schedule: str) -> None:
    def sched(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        if schedule == "cosine":
            return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))

    data = batches(30)
    ref = make_run(graph_safe=True, schedule=sched)
    initial = ref.params()
    expected = ref.train(data)

    run = make_run(schedule=sched)
    step = run.capture()
    got = run.train(data, step)

    assert step.stats.replays == 19
    assert not same(initial, ref.params())  # it trained
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())
    assert same(run.buffers(), ref.buffers())  # batch-norm statistics: no step doubled
    lr_ref, lr = ref.optimizer.param_groups[0]["lr"], run.optimizer.param_groups[0]["lr"]
    assert lr == lr_ref  # floats, computed by the same schedule
    for p_ref, p in zip(
        ref.optimizer.param_groups[0]["params"],
        run.optimizer.param_groups[0]["params"],
        strict=True,
    ):
        s_ref, s = ref.optimizer.state[p_ref], run.optimizer.state[p]
        assert set(s) == set(s_ref)
        assert all(torch.equal(s[k], s_ref[k]) for k in s)


def test_rng_after_capture_matches_eager(make_run, batches) -> None:
    data = batches(13)
    ref = make_run(graph_safe=True)
    ref.train(data)
    after_ref = torch.rand(4)
    run = make_run()
    run.train(data, run.capture())
    assert torch.equal(torch.rand(4), after_ref)


def test_without_clone_outputs_the_outputs_are_the_graphs(make_run, batches) -> None:
    data = batches(14)
    ref = make_run(graph_safe=True)
    expected = ref.train(data).losses

    run = make_run()
    step = run.capture(clone_outputs=False)
    torch.manual_seed(1)
    outs = []
    for x, y in data:
        outs.append(step(x, y))
        run.scheduler.step()
    assert outs[10] is not outs[11]  # warm-up returns fresh tensors
    assert outs[11] is outs[12] is outs[13]  # the capture call and every replay: one tensor
    assert float(outs[11]) == expected[13]  # holding the last replay's value
    assert float(outs[10]) == expected[10]


def test_losses_kept_in_a_list_keep_their_values(make_run, batches) -> None:
    """By default every replay returns copies: a loop that keeps its losses and reads them
    later (to log an average without a host sync each step) reads the right ones."""
    data = batches(14)
    ref = make_run(graph_safe=True)
    expected = ref.train(data).losses

    run = make_run()
    step = run.capture()
    torch.manual_seed(1)
    outs = []
    for x, y in data:
        outs.append(step(x, y))
        run.scheduler.step()
    assert len({id(t) for t in outs}) == len(outs)
    assert [float(t) for t in outs] == expected


def test_nested_and_keyword_arguments_are_copied_in(make_run, batches, same) -> None:
    data = batches(14)
    ref = make_run(graph_safe=True)
    ref.train(data)

    run = make_run()

    def fn(batch: dict[str, list[torch.Tensor]], *, scale: float) -> dict[str, torch.Tensor]:
        x, y = batch["xy"]
        return {"loss": run.step(x * scale, y)}

    step = ddpgraph.capture_step(
        fn, model=run.model, optimizer=run.optimizer, backend=ddpgraph.PassThroughBackend()
    )
    run.train(data, lambda x, y: step({"xy": [x, y]}, scale=1.0)["loss"])
    assert step.state is StepState.CAPTURED and step.stats.replays == 3
    assert same(run.params(), ref.params())


def test_plain_module_warms_up_3_steps(make_run, batches, same) -> None:
    data = batches(8)
    ref = make_run(ddp=False, graph_safe=True)
    expected = ref.train(data)
    run = make_run(ddp=False)
    step = run.capture()
    got = run.train(data, step)
    assert got.states == ["warmup"] * 3 + ["captured"] * 5
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())


@pytest.mark.parametrize(
    ("forwards_before", "capture_call", "recorded"),
    [(89, 2, 91), (98, 4, 102), (99, 3, 102), (100, 2, 102)],
)
def test_capture_skips_sampled_iterations_of_a_trained_model(
    make_run, batches, forwards_before: int, capture_call: int, recorded: int
) -> None:
    """A model that already ran n iterations is captured on the first call that records
    a forward k with neither k nor k - 1 sampled (1-10, every 100th), after at least one
    warm-up (probe) step."""
    run = make_run()
    for x, y in batches(forwards_before, size=2):
        run.step(x, y)
    counter = forward_counter(run.model)
    assert counter is not None and counter.count == forwards_before
    step = run.capture()
    seen = []
    trace = run.train(batches(capture_call + 1), step, before=lambda i: seen.append(counter.count))
    assert trace.states == ["warmup"] * (capture_call - 1) + ["captured"] * 2
    assert seen[capture_call - 1] + 1 == recorded  # the forward the capture call records


def test_lambda_step_and_a_list_of_optimizers(make_run, batches) -> None:
    run = make_run()
    step = ddpgraph.capture_step(
        lambda x, y: run.step(x, y),
        model=run.model,
        optimizer=[run.optimizer],
        backend=ddpgraph.PassThroughBackend(),
    )
    assert run.train(batches(12), step).states[-1] == "captured"


def test_no_optimizer_is_allowed(make_run, batches) -> None:
    run = make_run()

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(run.model(x), y)
        loss.backward()
        return loss.detach()

    step = ddpgraph.capture_step(
        forward_backward, model=run.model, backend=ddpgraph.PassThroughBackend()
    )
    for x, y in batches(12):
        step(x, y)
    assert step.state is StepState.CAPTURED


def test_close_frees_and_refuses_later_calls(make_run, batches) -> None:
    run = make_run()
    step = run.capture()
    data = batches(13)
    for x, y in data[:12]:
        step(x, y)
    step.close()
    assert step.state is StepState.CLOSED
    step.close()  # twice is fine
    params = run.params()
    with pytest.raises(ddpgraph.DdpGraphError) as info:
        step(*data[12])
    assert info.value.code is ddpgraph.Code.STEP_CLOSED
    assert "HINT:" in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(params, run.params(), strict=True))


def test_close_during_warmup(make_run, batches) -> None:
    run = make_run()
    step = run.capture()
    step(*batches(1)[0])
    step.close()
    with pytest.raises(ddpgraph.DdpGraphError, match="STEP_CLOSED"):
        step(*batches(1)[0])


def test_context_manager_closes(make_run, batches) -> None:
    run = make_run()
    with run.capture() as step:
        run.train(batches(12), step)
        assert step.state is StepState.CAPTURED
    assert step.state is StepState.CLOSED


def test_context_manager_closes_on_error(make_run) -> None:
    run = make_run()
    with pytest.raises(KeyError), run.capture() as step:
        raise KeyError("user code failed")
    assert step.state is StepState.CLOSED


def test_without_backend_on_cpu_runs_eagerly_with_no_cuda(make_run, batches, same) -> None:
    data = batches(14)
    ref = make_run()  # the optimizer is not touched: compare with the plain one
    expected = ref.train(data)

    run = make_run()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = ddpgraph.capture_step(
            run.step, model=run.model, optimizer=run.optimizer, on_failure="raise"
        )
        assert step.state is StepState.EAGER
        got = run.train(data, step)
    assert step.reason is not None and step.reason.code is ddpgraph.Code.NO_CUDA
    assert "HINT:" in step.reason.format()
    assert step.backend_name == "eager"
    assert not [w for w in caught if issubclass(w.category, ddpgraph.DdpGraphWarning)]
    assert got.states == ["eager"] * 14
    assert step.stats.eager_steps == 14 and step.stats.replays == 0
    assert isinstance(run.optimizer.param_groups[0]["lr"], float)
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())
