"""`capture_step` leaves the user's optimizer as written: floats in `param_groups`, their
own flags and defaults, schedules computed as without ddpgraph, plain checkpoints, and
the optimizer exactly as given after `close()`. Checkpoints from anywhere load into a
live captured step."""

from __future__ import annotations

import copy
import json
import warnings
from typing import Any

import pytest
import torch

import ddpgraph
from ddpgraph import Code

pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")


def _groups(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _typed(groups: list[dict[str, Any]]) -> list[dict[str, tuple[type, Any]]]:
    return [{k: (type(v), v) for k, v in g.items()} for g in groups]


def test_optimizer_keeps_floats_flags_and_defaults_and_close_gives_it_back_as_given(
    make_run, batches
) -> None:
    plain = make_run()
    plain.train(batches(15))
    run = make_run()
    opt = run.optimizer
    given_groups, given_defaults = copy.deepcopy(_groups(opt)), copy.deepcopy(opt.defaults)
    step = run.capture()
    seen: list[list[dict[str, tuple[type, Any]]]] = []
    run.train(batches(15), step, before=lambda i: seen.append(_typed(_groups(opt))))
    assert step.state is ddpgraph.StepState.CAPTURED
    for groups in seen[1:]:
        for g in groups:
            assert g["lr"][0] is float and g["foreach"] == (type(None), None)
    assert all(type(lr) is float for lr in run.scheduler.get_last_lr())
    assert opt.defaults == given_defaults
    step.close()
    assert _typed(_groups(opt))[0].keys() == _typed(given_groups)[0].keys()
    expected = _typed(given_groups)
    expected[0]["lr"] = (
        float,
        run.scheduler.get_last_lr()[0],
    )  # the schedule moved it, as eager does
    assert _typed(_groups(opt)) == expected
    assert opt.defaults == given_defaults
    assert set(vars(opt)) == set(vars(plain.optimizer))  # no attribute left behind
    assert not opt._optimizer_state_dict_post_hooks  # type: ignore[attr-defined]


def _exponential(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.99995)


def _linear(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=20)


@pytest.mark.parametrize("schedule", [_exponential, _linear], ids=["ExponentialLR", "LinearLR"])
def test_chainable_schedules_compute_exactly_what_they_compute_without_ddpgraph(
    make_run, batches, schedule
) -> None:
    run = make_run(schedule=schedule, lr=3e-4)
    plain_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    plain = schedule(plain_opt)
    step = run.capture()
    for x, y in batches(30):
        step(x, y)
        run.scheduler.step()
        plain.step()
        assert run.scheduler.get_last_lr() == plain.get_last_lr()  # floats, bit for bit
    assert step.state is ddpgraph.StepState.CAPTURED
    if schedule is _linear:
        assert run.optimizer.param_groups[0]["lr"] == pytest.approx(3e-4, rel=1e-12)  # not 3.001e-4


def test_state_dict_during_graphed_training_loads_into_a_plain_optimizer(make_run, batches) -> None:
    run = make_run()
    step = run.capture()
    run.train(batches(14), step)
    assert step.state is ddpgraph.StepState.CAPTURED
    saved = run.optimizer.state_dict()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]
    json.dumps(groups)  # a logger's view: plain numbers and flags
    assert groups[0]["lr"] == run.optimizer.param_groups[0]["lr"]
    plain = make_run(ddp=False)  # an ordinary optimizer, no ddpgraph
    plain.optimizer.load_state_dict(copy.deepcopy(saved))
    assert plain.optimizer.param_groups[0]["capturable"] is False
    plain.train(batches(2))


def _checkpoint_from(kind: str, make_run, batches) -> dict[str, Any]:
    """An optimizer checkpoint from ordinary training, graphed training, or another
    structure (AMSGrad keeps one more state tensor)."""
    other = make_run(amsgrad=True) if kind == "other_structure" else make_run()
    data = batches(13, seed=7)
    if kind == "graphed":
        other.train(data, other.capture())
    else:
        other.train(data)
    return copy.deepcopy(other.optimizer.state_dict())


@pytest.mark.parametrize("kind", ["ordinary", "graphed", "other_structure"])
def test_checkpoint_from_anywhere_loads_into_a_live_captured_step(
    make_run, batches, same, kind: str
) -> None:
    saved = _checkpoint_from(kind, make_run, batches)
    data = batches(22)

    def load(run):
        def before(i: int) -> None:
            if i == 14:
                run.optimizer.load_state_dict(copy.deepcopy(saved))

        return before

    ref = make_run(graph_safe=True)
    expected = ref.train(data, before=load(ref))
    run = make_run()
    step = run.capture()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the re-capture of another structure is logged
        got = run.train(data, step, before=load(run))
    if kind == "other_structure":  # one probe step, then captured again, graph-safe again
        assert got.states == ["warmup"] * 11 + ["captured"] * 3 + ["warmup"] + ["captured"] * 7
        assert step.stats.captures == 2
    else:
        assert got.states == ["warmup"] * 11 + ["captured"] * 11
        assert step.stats.captures == 1
    assert step.reason is None
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())


def test_scheduler_writing_lr_in_place_inside_the_step_is_still_refused(make_run, batches) -> None:
    run = make_run()

    def inside() -> None:
        run.optimizer.param_groups[0]["lr"].fill_(0.5)  # the mirror's tensor while installed

    run.inside = inside
    step = run.capture()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run.train(batches(14), step)
    assert got.states[-1] == "eager"
    assert step.reason is not None and step.reason.code is Code.LR_BAKED_INTO_GRAPH
    assert run.optimizer.param_groups[0]["lr"] == run.scheduler.get_last_lr()[0]


def _one_cycle(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=40)


def _cyclic(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.001, max_lr=0.05, step_size_up=5)


@pytest.mark.parametrize(
    ("optimizer", "schedule", "key", "kw"),
    [
        (torch.optim.AdamW, _one_cycle, "betas", {}),
        (torch.optim.SGD, _cyclic, "momentum", {"momentum": 0.9}),
    ],
    ids=["AdamW-OneCycleLR", "SGD-CyclicLR"],
)
def test_momentum_cycling_keeps_the_graph_where_the_kernel_reads_it_from_a_tensor(
    make_run, batches, same, monkeypatch, optimizer, schedule, key, kw
) -> None:
    # On CUDA the kernel is probed (tensor betas: yes for capturable AdamW where the
    # installed PyTorch has them; fused SGD: no tensor momentum). Here the stand-in is
    # told the kernel takes it.
    monkeypatch.setattr("ddpgraph.optimizer.kernel_support.CPU_TENSOR_KEYS", ("lr", key))
    data = batches(20)
    ref = make_run(optimizer=optimizer, schedule=schedule, graph_safe=True, **kw)
    expected = ref.train(data)
    run = make_run(optimizer=optimizer, schedule=schedule, **kw)
    step = run.capture()
    got = run.train(data, step)
    assert got.states == ["warmup"] * 11 + ["captured"] * 9, step.reason
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())
    value = run.optimizer.param_groups[0][key]
    assert not isinstance(value, torch.Tensor) and not any(
        isinstance(v, torch.Tensor) for v in (value if isinstance(value, tuple) else ())
    )
