"""`capture_eval` on CPU with the stand-in graph backend: modes put back, no DDP
training iteration counted, a captured training step undisturbed, and the pool rules."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import ddpgraph
from ddpgraph import Code, StepState
from ddpgraph.ddp.build import forward_counter
from ddpgraph.strategies.evaluation import capture_eval


def _predict(run: Any) -> Any:
    return lambda x: run.model(x).argmax(-1)


def test_evaluation_between_captured_training_steps(make_run, batches, same) -> None:
    data = batches(16)
    ref = make_run(converted=True)
    ref_preds = []

    def ref_eval(i: int) -> None:
        if i >= 1:
            ref.model.eval()
            with torch.no_grad():
                ref_preds.append(ref.model(data[0][0]).argmax(-1))
            ref.model.train()

    ref_trace = ref.train(data, before=ref_eval)
    run = make_run()
    step = run.capture()
    evaluate = capture_eval(_predict(run), model=run.model, backend=ddpgraph.PassThroughBackend())
    preds, counts, modes = [], [], []

    def run_eval(i: int) -> None:
        if i >= 1:
            count = forward_counter(run.model).count  # type: ignore[union-attr]
            sync = run.model.require_forward_param_sync
            preds.append(evaluate(data[0][0]).clone())
            counts.append(forward_counter(run.model).count - count)  # type: ignore[union-attr]
            modes.append(
                (
                    run.model.training,
                    run.model.module[3].training,
                    run.model.require_forward_param_sync == sync,
                )
            )

    trace = run.train(data, step, before=run_eval)
    assert evaluate.state is StepState.CAPTURED and evaluate.stats.captures == 1
    assert evaluate.stats.warmup_steps == 2 and evaluate.stats.replays == 13
    assert trace.states[-1] == "captured" and step.stats.replays == 16 - 11
    assert counts == [0] * 15  # evaluation is no DDP training iteration
    assert all(m == (True, True, True) for m in modes)
    assert same(preds, ref_preds)
    assert trace.losses == ref_trace.losses and same(run.params(), ref.params())
    assert same(run.buffers(), ref.buffers())


def test_modes_of_every_submodule_are_put_back(make_run, batches) -> None:
    run = make_run()
    run.model.module[3].eval()  # a submodule kept in eval mode by the user
    evaluate = capture_eval(_predict(run), model=run.model, backend=ddpgraph.PassThroughBackend())
    for x, _ in batches(4):
        evaluate(x)
        assert run.model.training and run.model.module[1].training
        assert not run.model.module[3].training
    assert torch.is_grad_enabled()


def test_other_inputs_run_eagerly(make_run, batches) -> None:
    run = make_run()
    evaluate = capture_eval(_predict(run), model=run.model, backend=ddpgraph.PassThroughBackend())
    data = batches(4)
    for x, _ in data:
        evaluate(x)
    odd = batches(1, size=5)[0][0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = evaluate(odd)
    assert out.shape == (5,) and evaluate.stats.input_changes == 1
    assert any("INPUT_SIGNATURE_CHANGED" in str(w.message) for w in caught)
    strict = capture_eval(
        _predict(run),
        model=run.model,
        backend=ddpgraph.PassThroughBackend(),
        on_input_change="raise",
    )
    for x, _ in data:
        strict(x)
    with pytest.raises(ddpgraph.DdpGraphError) as err:
        strict(odd)
    assert err.value.code is Code.INPUT_SIGNATURE_CHANGED


def test_a_failed_capture_falls_back_to_eager(make_run, batches) -> None:
    run = make_run()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        evaluate = capture_eval(
            _predict(run), model=run.model, backend=ddpgraph.PassThroughBackend(fail_ranks={0})
        )
        outs = [evaluate(x) for x, _ in batches(5)]
    assert evaluate.state is StepState.EAGER and evaluate.reason is not None
    assert evaluate.reason.code is Code.CAPTURE_FAILED and evaluate.stats.eager_steps == 3
    assert all(o.shape == (8,) for o in outs)


def test_without_cuda_it_runs_eagerly(make_run, batches) -> None:
    run = make_run()
    evaluate = capture_eval(_predict(run), model=run.model)
    evaluate(batches(1)[0][0])
    assert evaluate.state is StepState.EAGER and evaluate.reason is not None
    assert evaluate.reason.code is Code.NO_CUDA


class _TrainingStep:
    """Stands for a captured training step: its state and capture count."""

    def __init__(self) -> None:
        self.state = StepState.WARMUP
        self.stats = ddpgraph.StepStats()


def test_a_shared_pool_waits_for_the_training_capture_and_follows_it(make_run, batches) -> None:
    run = make_run()
    training = _TrainingStep()
    evaluate = capture_eval(
        _predict(run),
        model=run.model,
        training_step=training,
        pool=object(),
        backend=ddpgraph.PassThroughBackend(),
    )
    assert evaluate.pool_shared
    x = batches(1)[0][0]
    for _ in range(4):
        out = evaluate(x)
    assert evaluate.state is StepState.WARMUP and evaluate.stats.captures == 0  # waits
    training.state, training.stats.captures = StepState.CAPTURED, 1
    first = evaluate(x)
    assert evaluate.state is StepState.CAPTURED and evaluate.stats.captures == 1
    assert first is not evaluate(x)  # outputs are cloned when the pool is shared
    training.stats.captures = 2  # the training step was captured again
    evaluate(x)
    assert evaluate.stats.captures == 2 and torch.equal(out, first)


def test_compiling_in_the_last_warmup_call_extends_the_warmup(
    make_run, batches, monkeypatch
) -> None:
    run = make_run()
    compiles = iter([0, 1, 1, 1, 1, 1, 1, 1])  # the probe call compiles once
    monkeypatch.setattr("ddpgraph.strategies.evaluation.compile_count", lambda: next(compiles))
    evaluate = capture_eval(
        _predict(run), model=run.model, warmup_steps=1, backend=ddpgraph.PassThroughBackend()
    )
    x = batches(1)[0][0]
    evaluate(x)
    assert evaluate.state is StepState.WARMUP
    evaluate(x)
    assert evaluate.state is StepState.WARMUP and evaluate.stats.warmup_steps == 2
    evaluate(x)
    assert evaluate.state is StepState.CAPTURED


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup_steps": 0}, "warmup_steps"),
        ({"on_failure": "skip"}, "on_failure"),
        ({"model": "net"}, "torch.nn.Module"),
    ],
)
def test_usage_errors(make_run, kwargs: dict[str, Any], match: str) -> None:
    run = make_run()
    kwargs.setdefault("model", run.model)
    with pytest.raises(ddpgraph.DdpGraphUsageError, match=match):
        capture_eval(_predict(run), **kwargs)


def test_closed(make_run, batches) -> None:
    run = make_run()
    with capture_eval(
        _predict(run), model=run.model, backend=ddpgraph.PassThroughBackend()
    ) as evaluate:
        evaluate(batches(1)[0][0])
    assert evaluate.state is StepState.CLOSED
    with pytest.raises(ddpgraph.DdpGraphError) as err:
        evaluate(batches(1)[0][0])
    assert err.value.code is Code.STEP_CLOSED


def test_predictions_kept_across_calls_keep_their_values_unless_told_otherwise(
    make_run, batches
) -> None:
    """By default each replay returns copies; `clone_outputs=False` returns the graph's own
    tensor every call, overwritten by the next."""
    run = make_run()
    xs = [x for x, _ in batches(6)]
    run.model.eval()
    with torch.no_grad():
        expected = [run.model(x).argmax(-1) for x in xs]
    run.model.train()
    kept = capture_eval(_predict(run), model=run.model, backend=ddpgraph.PassThroughBackend())
    outs = [kept(x) for x in xs]
    assert kept.state is StepState.CAPTURED and kept.stats.replays >= 3
    assert all(torch.equal(a, b) for a, b in zip(outs, expected, strict=True))
    owned = capture_eval(
        _predict(run), model=run.model, backend=ddpgraph.PassThroughBackend(), clone_outputs=False
    )
    graph_outs = [owned(x) for x in xs]
    assert graph_outs[-1] is graph_outs[-2] is graph_outs[-3]
