"""Every hyper-parameter a schedule changes stays live in the graph, on CPU with the
recording backend (replays run no Python): the learning rate through the mirror, Adam's
`betas[0]` and SGD's `momentum` through ddpgraph's own update; the optimizer as the
user wrote it is graph-safe there (the default AdamW, `foreach=True`, a checkpoint's
`fused=None`); a list hyper-parameter changed in place is seen. Each captured run is
compared bit for bit with eager training with the same settings (`graph_safe=True`).
The same schedules at 2 and 4 processes: tests/dist/test_schedules_gloo.py."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ddpgraph import Code, RecordingBackend

LRScheduler = torch.optim.lr_scheduler.LRScheduler


def _quiet_train(
    run: Any, data: Any, step: Any, before: Callable[[int], None] | None = None
) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fallback's warning, where one is expected
        return run.train(data, step, before=before)


def _one_cycle(opt: torch.optim.Optimizer) -> LRScheduler:
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=40)


def _cyclic(opt: torch.optim.Optimizer) -> LRScheduler:
    return torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.001, max_lr=0.05, step_size_up=4)


def _chained(opt: torch.optim.Optimizer) -> LRScheduler:
    return torch.optim.lr_scheduler.ChainedScheduler(
        [torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=5), _cyclic(opt)]
    )


@pytest.mark.parametrize(
    ("optimizer", "schedule", "kw"),
    [
        (torch.optim.AdamW, _one_cycle, {}),
        (torch.optim.Adam, _cyclic, {"weight_decay": 0.01, "amsgrad": True}),
        (torch.optim.SGD, _one_cycle, {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-4}),
        (torch.optim.SGD, _chained, {"momentum": 0.9, "dampening": 0.1}),
    ],
    ids=[
        "AdamW-OneCycleLR",
        "Adam-amsgrad-CyclicLR",
        "SGD-nesterov-OneCycleLR",
        "SGD-ChainedScheduler",
    ],
)
def test_a_cycled_momentum_stays_captured_and_equals_eager(
    make_run, batches, same, optimizer, schedule, kw
) -> None:
    data = batches(20)
    ref = make_run(optimizer=optimizer, schedule=schedule, graph_safe=True, **kw)
    expected = ref.train(data)
    run = make_run(optimizer=optimizer, schedule=schedule, **kw)
    step = run.capture(backend=RecordingBackend())
    got = run.train(data, step)
    assert got.states == ["warmup"] * 11 + ["captured"] * 9, step.reason
    assert step.stats.captures == 1 and step.stats.replays == 9
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())
    key = "betas" if optimizer is not torch.optim.SGD else "momentum"
    value = run.optimizer.param_groups[0][key]
    assert not isinstance(value, torch.Tensor) and not any(
        isinstance(v, torch.Tensor) for v in (value if isinstance(value, tuple) else ())
    )
    step.close()
    assert "step" not in run.optimizer.__dict__ or getattr(
        run.optimizer.step, "_wrapped_by_lr_sched", False
    )


@pytest.mark.parametrize(
    "kw", [{}, {"foreach": True}, {"fused": False}], ids=["default", "foreach", "fused-False"]
)
def test_adamw_as_written_records_on_cpu(make_run, batches, same, kw) -> None:
    # The recording backend refuses a step that reads the host, as a CUDA capture does;
    # the graph-safe mode on CPU is AdamW's fused kernel, installed for the step only.
    data = batches(14)
    ref = make_run(graph_safe=True, **kw)
    expected = ref.train(data)
    run = make_run(**kw)
    step = run.capture(backend=RecordingBackend())
    got = run.train(data, step)
    assert got.states == ["warmup"] * 11 + ["captured"] * 3, step.reason
    assert got.losses == expected.losses and same(run.params(), ref.params())
    assert run.optimizer.param_groups[0]["fused"] == kw.get("fused")  # as written


def test_a_checkpoint_whose_fused_is_none_keeps_the_step_recordable(
    make_run, batches, same
) -> None:
    saved = make_run().optimizer.state_dict()  # a plain AdamW's: `fused=None`
    assert saved["param_groups"][0]["fused"] is None

    def load(run: Any) -> Callable[[int], None]:
        return lambda i: run.optimizer.load_state_dict(copy.deepcopy(saved)) if i == 3 else None

    data = batches(14)
    ref = make_run(graph_safe=True, fused=True)
    expected = ref.train(data, before=load(ref))
    run = make_run(fused=True)
    step = run.capture(backend=RecordingBackend())
    got = run.train(data, step, before=load(run))
    assert got.states == ["warmup"] * 11 + ["captured"] * 3, step.reason
    assert got.losses == expected.losses and same(run.params(), ref.params())


def _with_list_betas(run: Any) -> Any:
    # Adam's constructor makes a tuple of the betas it is given; a loop or a config
    # loader can still put a list into the group.
    run.optimizer.param_groups[0]["betas"] = [0.9, 0.999]
    if run.safe is not None:
        run.safe.after_load(run.optimizer)
    return run


def _list_changed_at_14(
    make_run: Any, batches: Any, same: Any, index: int, value: float
) -> tuple[Any, Any]:
    """Train with list betas whose element `index` is set to `value` in place at call
    15 (after capture), captured and eagerly with the same settings; equal bit for bit."""

    def change(run: Any) -> Callable[[int], None]:
        def before(i: int) -> None:
            if i == 14:
                run.optimizer.param_groups[0]["betas"][index] = value

        return before

    data = batches(18)
    ref = _with_list_betas(make_run(graph_safe=True))
    expected = ref.train(data, before=change(ref))
    run = _with_list_betas(make_run())
    step = run.capture(backend=RecordingBackend())
    got = _quiet_train(run, data, step, change(run))
    assert got.losses == expected.losses and same(run.params(), ref.params())
    return got, step


def test_a_frozen_element_of_a_list_changed_in_place_is_seen(make_run, batches, same) -> None:
    got, step = _list_changed_at_14(make_run, batches, same, 1, 0.5)
    assert got.states == ["warmup"] * 11 + ["captured"] * 3 + ["eager"] * 4
    reason = step.reason
    assert reason is not None and reason.code is Code.LR_BAKED_INTO_GRAPH
    assert "changed from [0.9, 0.999] to [0.9, 0.5] after capture" in reason.happened
    assert "the rest of `betas` is a Python number" in reason.hint


def test_the_live_element_of_a_list_changed_in_place_is_followed(make_run, batches, same) -> None:
    got, step = _list_changed_at_14(make_run, batches, same, 0, 0.8)
    assert got.states == ["warmup"] * 11 + ["captured"] * 3 + ["warmup"] + ["captured"] * 3
    assert step.reason is None and step.stats.captures == 2


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_a_list_changed_in_place_inside_the_step_is_found_by_the_probe(make_run, batches) -> None:
    run = _with_list_betas(make_run())
    calls = [0]

    def inside() -> None:  # a hand-written schedule inside the step, in place
        calls[0] += 1
        run.optimizer.param_groups[0]["betas"][1] = 0.999 - 1e-4 * calls[0]

    run.inside = inside
    step = run.capture(backend=RecordingBackend())
    got = _quiet_train(run, batches(13), step)
    assert got.states == ["warmup"] * 10 + ["eager"] * 3, (got.states, step.reason)
    reason = step.reason
    assert reason is not None and reason.code is Code.LR_BAKED_INTO_GRAPH
    assert "the step function changes `AdamW.param_groups[0]['betas']`" in reason.happened
