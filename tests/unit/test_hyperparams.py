"""The hyper-parameter mirror: device tensors ddpgraph fills from the user's values, and
the graph-safe mode it installs only while a step runs or records."""

from __future__ import annotations

import pytest
import torch
from torch.optim import Optimizer

from ddpgraph.optimizer.hyperparams import HyperparamChange, HyperparamMirror
from ddpgraph.optimizer.kernel_support import KernelSupport, kernel_support

CPU = torch.device("cpu")


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]


def _mirror(
    opt: Optimizer, keys: tuple[str, ...] = ("lr",), flags: tuple[tuple[str, object], ...] = ()
) -> HyperparamMirror:
    return HyperparamMirror(opt, [KernelSupport(flags, keys, ())] * len(opt.param_groups), CPU)


def test_cpu_support_is_the_fused_kernel_with_the_learning_rate_in_a_tensor() -> None:
    opt = torch.optim.AdamW(_params(), lr=0.1)
    support = kernel_support(opt, opt.param_groups[0])
    fused = (("fused", True), ("foreach", False))
    assert support == KernelSupport(fused, ("lr",), (), own_keys=("betas",), reads_host=False)


def test_a_value_is_filled_only_when_it_changed() -> None:
    opt = torch.optim.AdamW(_params(), lr=0.1)
    mirror = _mirror(opt)
    [tensor] = mirror.slots[0]["lr"].tensors
    assert tensor.item() == pytest.approx(0.1) and tensor.dtype == torch.float32
    tensor.fill_(7.0)  # a sentinel: a sync of an unchanged value must not touch it
    assert mirror.sync() == []
    assert tensor.item() == 7.0
    opt.param_groups[0]["lr"] = 0.05  # a hand-written schedule
    assert mirror.sync() == []
    assert tensor.item() == pytest.approx(0.05)
    assert opt.param_groups[0]["lr"] == 0.05  # the user's float stays


def test_install_puts_tensors_and_flags_in_and_uninstall_gives_the_exact_values_back() -> None:
    opt = torch.optim.AdamW(_params(), lr=0.1, betas=(0.8, 0.9))
    betas = opt.param_groups[0]["betas"]
    attrs = dict(vars(opt))
    mirror = _mirror(opt, ("lr", "betas"), (("capturable", True),))
    mirror.install()
    group = opt.param_groups[0]
    assert isinstance(group["lr"], torch.Tensor) and group["capturable"] is True
    assert all(isinstance(b, torch.Tensor) for b in group["betas"])
    assert opt._warned_capturable_if_run_uncaptured is True  # type: ignore[attr-defined]
    mirror.uninstall()
    assert group["lr"] == 0.1 and type(group["lr"]) is float
    assert group["betas"] is betas and group["capturable"] is False
    assert vars(opt).keys() == attrs.keys()
    assert all(vars(opt)[k] is v for k, v in attrs.items())


def test_a_value_assigned_inside_the_step_is_kept() -> None:
    opt = torch.optim.AdamW(_params(), lr=0.1)
    mirror = _mirror(opt)
    mirror.install()
    opt.param_groups[0]["lr"] = 0.3
    mirror.uninstall()
    assert opt.param_groups[0]["lr"] == 0.3


def test_read_back_keeps_a_value_written_into_the_tensor_inside_the_step() -> None:
    opt = torch.optim.AdamW(_params(), lr=0.1)
    mirror = _mirror(opt)
    mirror.install()
    opt.param_groups[0]["lr"].fill_(0.25)  # what a scheduler stepped inside the step does
    mirror.uninstall(read_back=True)
    assert opt.param_groups[0]["lr"] == 0.25


def test_the_users_own_device_tensor_is_read_directly() -> None:
    lr = torch.tensor(0.1)
    opt = torch.optim.AdamW(_params(), lr=lr)
    mirror = _mirror(opt)
    assert mirror.slots[0]["lr"].tensors[0] is lr
    lr.fill_(0.2)  # a scheduler on a tensor lr: the graph reads it in place
    assert mirror.sync() == [] and mirror.slots[0]["lr"].tensors[0].item() == pytest.approx(0.2)


def test_a_tensor_value_is_copied_and_a_wrong_form_is_reported() -> None:
    opt = torch.optim.AdamW(_params(), lr=0.1, betas=(0.8, 0.9))
    mirror = _mirror(opt, ("lr", "betas"))
    opt.param_groups[0]["lr"] = torch.tensor([0.02], dtype=torch.float64)
    assert mirror.sync() == []
    assert mirror.slots[0]["lr"].tensors[0].item() == pytest.approx(0.02)
    opt.param_groups[0]["lr"] = torch.tensor([0.1, 0.2])
    opt.param_groups[0]["betas"] = (0.7, 0.9, 0.1)
    assert [(c.key, c.applied) for c in mirror.sync()] == [("lr", False), ("betas", False)]


def test_cycled_betas_are_filled_element_by_element() -> None:
    opt = torch.optim.AdamW(_params(), lr=0.1, betas=(0.8, 0.9))
    mirror = _mirror(opt, ("lr", "betas"))
    opt.param_groups[0]["betas"] = (0.85, 0.9)  # what OneCycleLR's momentum cycling assigns
    assert mirror.sync() == []
    assert [t.item() for t in mirror.slots[0]["betas"].tensors] == pytest.approx([0.85, 0.9])


def test_frozen_values_changed_after_capture_are_reported() -> None:
    opt = torch.optim.AdamW(_params(), lr=0.1, weight_decay=0.0)
    mirror = _mirror(opt)
    assert mirror.frozen_changes() == []  # nothing captured yet
    mirror.freeze()
    opt.param_groups[0]["lr"] = 0.2  # mirrored: not frozen
    assert mirror.frozen_changes() == []
    opt.param_groups[0]["weight_decay"] = 0.1
    assert mirror.frozen_changes() == [HyperparamChange(0, "weight_decay", 0.0, 0.1, False)]
    opt.param_groups[0]["weight_decay"] = 0.0
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert mirror.frozen_changes() == [HyperparamChange(-1, "param_groups", 1, 2, False)]


def test_the_flags_the_mode_sets_are_not_frozen_values() -> None:
    # A checkpoint from another run may bring its own `capturable`; the graph-safe mode
    # sets it in every step anyway.
    opt = torch.optim.AdamW(_params(), lr=0.1)
    mirror = _mirror(opt, ("lr",), (("capturable", True),))
    mirror.freeze()
    opt.param_groups[0]["capturable"] = True
    assert mirror.frozen_changes() == []
    opt.param_groups[0]["amsgrad"] = True
    assert [c.key for c in mirror.frozen_changes()] == ["amsgrad"]


def test_a_value_only_the_first_step_reads_is_found_by_trying_and_not_frozen() -> None:
    # Rprop reads `lr` once, to initialise its step sizes: a schedule on it changes
    # neither eager training nor a replay, so it must not drop the graph.
    from ddpgraph.optimizer.kernel_support import _first_step_only, _two_steps

    def first_only(cls: type[Optimizer], options: dict[str, object], key: str) -> bool:
        unchanged = _two_steps(cls, options, (), CPU, torch.float32, third={})
        return _first_step_only(cls, options, key, CPU, torch.float32, unchanged)

    rprop = {"lr": 0.01, "etas": (0.5, 1.2), "step_sizes": (1e-6, 50.0), "foreach": False}
    assert first_only(torch.optim.Rprop, rprop, "lr")
    assert not first_only(torch.optim.Rprop, rprop, "etas")
    adamw = {"lr": 0.01, "weight_decay": 0.0, "eps": 1e-8, "foreach": False}
    assert not any(first_only(torch.optim.AdamW, adamw, k) for k in ("lr", "weight_decay", "eps"))
    opt = torch.optim.Rprop(_params(), lr=0.01)
    mirror = HyperparamMirror(opt, [KernelSupport((), (), (), ("lr",))], CPU)
    mirror.freeze()
    opt.param_groups[0]["lr"] = 0.005
    assert mirror.frozen_changes() == []
    opt.param_groups[0]["etas"] = (0.4, 1.2)
    assert [c.key for c in mirror.frozen_changes()] == ["etas"]


def test_the_same_value_object_again_is_not_looked_at() -> None:
    opt = torch.optim.AdamW(_params(), lr=0.1)
    mirror = _mirror(opt)
    [tensor] = mirror.slots[0]["lr"].tensors
    tensor.fill_(7.0)  # a sentinel, as above
    assert mirror.sync() == []
    assert tensor.item() == 7.0
    lr = torch.tensor(0.3)  # a tensor value is copied every time: it may change in place
    opt.param_groups[0]["lr"] = lr
    assert mirror.sync() == []
    lr.fill_(0.4)
    assert mirror.sync() == [] and tensor.item() == pytest.approx(0.4)
    opt.param_groups[0]["lr"] = 0.25
    assert mirror.sync() == [] and tensor.item() == pytest.approx(0.25)


def test_scheduler_keys_are_not_hyperparameters() -> None:
    opt = torch.optim.SGD(_params(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=20)
    mirror = _mirror(opt)
    mirror.freeze()
    opt.param_groups[0]["max_lr"] = 1.0  # a scheduler's own bookkeeping, read by no step
    assert mirror.frozen_changes() == []
    opt.step()
    sched.step()  # cycles momentum, a frozen value for this mirror
    assert [c.key for c in mirror.frozen_changes()] == ["momentum"]


def test_before_replay_follows_every_change_after_replays_that_found_none() -> None:
    opt = torch.optim.AdamW(_params(), lr=0.1, weight_decay=0.0)
    mirror = _mirror(opt)
    [tensor] = mirror.slots[0]["lr"].tensors
    mirror.freeze()
    assert mirror.before_replay() == [] and mirror.before_replay() == []  # the quiet path from here
    opt.param_groups[0]["lr"] = 0.05  # a scheduler's new float
    assert mirror.before_replay() == [] and tensor.item() == pytest.approx(0.05)
    lr = torch.tensor(0.3)
    opt.param_groups[0]["lr"] = lr
    assert mirror.before_replay() == []
    lr.fill_(0.4)  # the same object, changed in place: still copied
    assert mirror.before_replay() == [] and tensor.item() == pytest.approx(0.4)
    opt.param_groups[0]["lr"] = 0.1
    assert mirror.before_replay() == [] and mirror.before_replay() == []
    opt.param_groups[0]["weight_decay"] = 0.1  # frozen in the graph
    assert mirror.before_replay() == [HyperparamChange(0, "weight_decay", 0.0, 0.1, False)]
    opt.param_groups[0]["weight_decay"] = 0.0
    assert mirror.before_replay() == [] and mirror.before_replay() == []
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert mirror.before_replay() == [HyperparamChange(-1, "param_groups", 1, 2, False)]


def test_a_scheduler_assigning_every_step_is_followed_key_by_key() -> None:
    # The usual captured training: a new lr float before every replay, now and then
    # another key. Only the assigned keys are looked at; every answer is the full pass's.
    opt = torch.optim.AdamW(_params(), lr=0.1, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    mirror = _mirror(opt)
    [tensor] = mirror.slots[0]["lr"].tensors
    mirror.freeze()
    assert mirror.before_replay() == []
    for _ in range(4):
        opt.step()
        sched.step()
        assert mirror.before_replay() == [] and tensor.item() == pytest.approx(
            sched.get_last_lr()[0]
        )
    opt.param_groups[0]["weight_decay"] = float("0.0")  # another object, the same value
    assert mirror.before_replay() == []
    opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"] = 0.02, 0.1
    assert mirror.before_replay() == [HyperparamChange(0, "weight_decay", 0.0, 0.1, False)]
    assert tensor.item() == pytest.approx(0.02)
    opt.param_groups[0]["weight_decay"] = 0.0
    assert mirror.before_replay() == []
    opt.param_groups[0]["lr"] = "0.1"  # a form no tensor takes
    assert [c.key for c in mirror.before_replay()] == ["lr"]
