"""`ddpgraph.accumulate`: micro-batches inside one step, DDP's all-reduce on the last only."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ddpgraph
from ddpgraph import StepState
from ddpgraph.ddp.build import forward_counter
from ddpgraph.training.accumulate import accumulate, split_batch
from ddpgraph.training.scaler import GraphSafeGradScaler


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(n: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=gen), torch.randint(0, 4, (n,), generator=gen)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _count_allreduces(ddp: Any) -> list[int]:
    """A DDP communication hook that all-reduces as the default one does, and counts."""
    calls = [0]

    # DDP checks the hook's annotations at run time, which string annotations fail.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        calls[0] += 1
        tensor = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, hook)
    return calls


# ------------------------------------------------------------------ splitting
def test_split_batch_splits_every_tensor_and_repeats_other_leaves() -> None:
    x, y = _batch(6)
    parts = split_batch({"x": x, "y": y, "scale": 2.0}, 3)
    assert len(parts) == 3
    for i, part in enumerate(parts):
        assert torch.equal(part["x"], x[2 * i : 2 * i + 2]) and torch.equal(
            part["y"], y[2 * i : 2 * i + 2]
        )
        assert part["scale"] == 2.0
        assert part["x"].data_ptr() == x[2 * i].data_ptr()  # a view: nothing copied
    first, _ = split_batch((x, y), 2)
    assert first[0].shape == (3, 16) and first[1].shape == (3,)


@pytest.mark.parametrize(
    ("batch", "k", "message"),
    [
        (_batch(10), 4, "does not split into 4"),
        ((torch.ones(4, 2), torch.ones(5)), 2, "share their first dimension"),
        (_batch(4), 0, "expected an int >= 1"),
        ({"n": 3}, 1, "share their first dimension"),
    ],
)
def test_split_batch_refuses_what_it_cannot_split(batch: Any, k: int, message: str) -> None:
    with pytest.raises(ddpgraph.DdpGraphUsageError, match=message):
        split_batch(batch, k)


# ------------------------------------------------------------------ arithmetic
@pytest.mark.parametrize("k", [1, 2, 4])
def test_gradients_are_those_of_the_full_batch_mean(k: int) -> None:
    x, y = _batch(8)
    full, acc = _model(), _model()
    F.cross_entropy(full(x), y).backward()
    loss = accumulate(acc, (x, y), lambda xb, yb: F.cross_entropy(acc(xb), yb), micro_batches=k)
    for a, b in zip(_grads(acc), _grads(full), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss, F.cross_entropy(full(x), y).detach(), rtol=1e-6, atol=0)
    assert not loss.requires_grad and loss.dim() == 0


def test_a_list_of_micro_batches_and_a_split_batch_agree_bit_for_bit() -> None:
    x, y = _batch(8)
    a, b = _model(), _model()
    la = accumulate(a, (x, y), lambda xb, yb: F.cross_entropy(a(xb), yb), micro_batches=2)
    lb = accumulate(b, [(x[:4], y[:4]), (x[4:], y[4:])], lambda xb, yb: F.cross_entropy(b(xb), yb))
    assert torch.equal(la, lb)
    assert all(torch.equal(g, h) for g, h in zip(_grads(a), _grads(b), strict=True))


def test_single_tensor_micro_batches_are_passed_alone() -> None:
    model = _model()
    x, _ = _batch(4)
    loss = accumulate(model, [x[:2], x[2:]], lambda xb: model(xb).square().mean())
    assert loss.dim() == 0


def test_scaler_scales_each_micro_batch() -> None:
    x, y = _batch(8)
    plain, scaled = _model(), _model()
    accumulate(plain, (x, y), lambda xb, yb: F.cross_entropy(plain(xb), yb), micro_batches=2)
    scaler = GraphSafeGradScaler(init_scale=1024.0)
    accumulate(
        scaled,
        (x, y),
        lambda xb, yb: F.cross_entropy(scaled(xb), yb),
        micro_batches=2,
        scaler=scaler,
    )
    for g, h in zip(_grads(scaled), _grads(plain), strict=True):
        torch.testing.assert_close(g, h * 1024.0, rtol=1e-6, atol=0)


def test_misuse_names_the_fix() -> None:
    model = _model()
    x, y = _batch(4)
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="micro_batches=k") as info:
        accumulate(model, (x, y), lambda xb, yb: F.cross_entropy(model(xb), yb))
    assert "got tuple" in str(info.value)
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="scalar loss"):
        accumulate(model, [x], lambda xb: model(xb))


# ------------------------------------------------------------------ with DDP
def test_ddp_all_reduces_once_per_step_and_counts_one_iteration(process_group: Any) -> None:
    ddp = ddpgraph.prepare_ddp(_model())
    calls = _count_allreduces(ddp)
    counter = forward_counter(ddp)
    assert counter is not None
    x, y = _batch(12)
    for _ in range(3):
        accumulate(ddp, (x, y), lambda xb, yb: F.cross_entropy(ddp(xb), yb), micro_batches=3)
    assert calls[0] == 3  # one bucket, one all-reduce per accumulated step, not per micro-batch
    assert counter.count == 3


def test_captured_accumulation_equals_eager_and_warms_up_as_usual(
    process_group: Any, same: Any
) -> None:
    def build() -> tuple[Any, torch.optim.Optimizer, Any]:
        ddp = ddpgraph.prepare_ddp(_model())
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = accumulate(
                ddp, (x, y), lambda xb, yb: F.cross_entropy(ddp(xb), yb), micro_batches=4
            )
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            return loss

        return ddp, opt, train_step

    data = [_batch(8, seed=i) for i in range(15)]
    ref_ddp, ref_opt, ref_step = build()
    ddpgraph.graph_safe_optimizer(ref_opt, tensor_lr_on_cpu=True)
    ref = [float(ref_step(x, y)) for x, y in data]

    ddp, opt, train_step = build()
    calls = _count_allreduces(ddp)
    step = ddpgraph.capture_step(
        train_step, model=ddp, optimizer=opt, backend=ddpgraph.PassThroughBackend()
    )
    losses = []
    for x, y in data:
        losses.append(float(step(x, y)))
    assert step.state is StepState.CAPTURED
    assert step.stats.warmup_steps == 11 and step.stats.replays == 4
    assert losses == ref
    assert same([p.detach() for p in ddp.parameters()], [p.detach() for p in ref_ddp.parameters()])
    # The stand-in runs the step for every call, and once more to record it.
    assert calls[0] == len(data) + 1


def test_no_sync_inside_the_step_is_refused_naming_the_forward_under_it(process_group) -> None:
    """Accumulation across calls written inside the step (`no_sync()` on every other call):
    refused at the probe step, the finding at the forward that ran without sync."""
    import contextlib

    torch.manual_seed(0)
    ddp = ddpgraph.prepare_ddp(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    calls = {"n": 0}

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        sync = calls["n"] % 2 == 0
        with contextlib.nullcontext() if sync else ddp.no_sync():
            loss = F.cross_entropy(ddp(x), y)  # under no_sync
            loss.backward()
        if sync:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    step = ddpgraph.capture_step(
        train_step, model=ddp, optimizer=opt, backend=ddpgraph.PassThroughBackend()
    )
    with pytest.warns(ddpgraph.DdpGraphWarning):
        for i in range(14):
            step(*_batch(seed=i))
    reason = step.reason
    assert step.state is StepState.EAGER and reason is not None
    assert reason.code is ddpgraph.Code.UNSUPPORTED_SETUP and "no_sync" in reason.happened
    assert reason.location is not None
    assert reason.location.source == "loss = F.cross_entropy(ddp(x), y)  # under no_sync"
