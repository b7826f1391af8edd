"""Training-loop pieces across processes on CPU (gloo), with the stand-in graph backend.

Each scenario trains the same model from the same state and data eagerly and through
`capture_step`, step by step, and reports what the tests compare. The helpers at the top
(`Poison`, `Trajectory`, `net`, `batches`) are device-agnostic; tests/scenarios/
gpu_training.py uses them for the same loops on GPUs.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import harness
import torch
import torch.nn.functional as F
from torch import nn

import ddpgraph
from ddpgraph.ddp.distributed import DistInfo
from ddpgraph.training.accumulate import accumulate
from ddpgraph.training.checkpoint import load_training_state, training_state
from ddpgraph.training.monitor import NonFiniteMonitor
from ddpgraph.training.scaler import GraphSafeGradScaler

Batch = tuple[torch.Tensor, torch.Tensor]


# ------------------------------------------------------------------ shared helpers
class Net(nn.Module):
    def __init__(self, dim: int, hidden: int, classes: int, dropout: float, norm: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.norm: nn.Module = nn.BatchNorm1d(hidden) if norm else nn.Identity()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(F.gelu(self.norm(self.fc1(x))))
        return self.out(F.gelu(self.fc2(h)))


def net(
    info: DistInfo,
    *,
    dim: int = 16,
    hidden: int = 32,
    classes: int = 4,
    dropout: float = 0.0,
    norm: bool = False,
) -> Net:
    torch.manual_seed(0)
    return Net(dim, hidden, classes, dropout, norm).to(info.device)


def batches(
    info: DistInfo, n: int, *, size: int = 8, dim: int = 16, classes: int = 4, seed: int = 100
) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed + info.rank)
    out = []
    for _ in range(n):
        x = torch.randn(size, dim, generator=gen)
        out.append((x.to(info.device), (x[:, :classes].argmax(1)).to(info.device)))
    return out


class Poison:
    """An inf (or NaN) added inside the step, at chosen calls on chosen ranks.

    The decision is taken on the device: a call counter kept as a buffer of `model` (so
    that `capture_step` puts it back after a stand-in recording) is compared with this
    rank's targets. Eager steps, replays and the stand-in all poison the same calls.
    Add `poison.value()` to a loss, or `poison.grad_hook(param)` to make a gradient
    infinite before DDP's all-reduce; each call of `value()` is one count.
    """

    def __init__(
        self,
        model: nn.Module,
        info: DistInfo,
        calls: Iterable[int],
        ranks: Iterable[int],
        *,
        value: float = math.inf,
    ):
        model.register_buffer(
            "poison_calls", torch.zeros((), dtype=torch.int64, device=info.device)
        )
        self._model = model
        hit = sorted(calls) if info.rank in set(ranks) else [-1]
        self._targets = torch.tensor(hit, dtype=torch.int64, device=info.device)
        self._value = torch.tensor(value, device=info.device)
        self._zero = torch.zeros((), device=info.device)

    def value(self) -> torch.Tensor:
        calls: torch.Tensor = self._model.poison_calls  # type: ignore[assignment]
        hit = (calls == self._targets).any()
        calls.add_(1)
        return torch.where(hit, self._value, self._zero)

    def grad_hook(self, param: torch.Tensor) -> None:
        param.register_hook(lambda g: g + self.value())


@dataclass
class Trajectory:
    """What a run did, step by step: losses, parameters, optimizer state, other values."""

    losses: list[float] = field(default_factory=list)
    params: list[list[torch.Tensor]] = field(default_factory=list)
    states: list[list[torch.Tensor]] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=dict)

    def add(
        self,
        loss: torch.Tensor,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        **values: float,
    ) -> None:
        self.losses.append(float(loss))
        self.params.append([_copy(t) for t in [*model.parameters(), *model.buffers()]])
        self.states.append(
            [
                _copy(v)
                for group in optimizer.param_groups
                for p in group["params"]
                for v in optimizer.state.get(p, {}).values()
                if isinstance(v, torch.Tensor)
            ]
        )
        for key, value in values.items():
            self.values.setdefault(key, []).append(value)


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def compare(ref: Trajectory, run: Trajectory) -> dict[str, Any]:
    """Worst relative differences over all steps, and whether the runs are bit-identical."""
    param_diffs = [harness.rel_diff(a, b) for a, b in zip(ref.params, run.params, strict=True)]
    state_diffs = [harness.rel_diff(a, b) for a, b in zip(ref.states, run.states, strict=True)]
    value_diffs = {
        k: harness.loss_rel_diff(ref.values[k], run.values.get(k, [])) for k in ref.values
    }
    return {
        "steps": len(run.losses),
        "loss_rel_diff": harness.loss_rel_diff(ref.losses, run.losses),
        "param_rel_diff": max(param_diffs, default=0.0),
        "state_rel_diff": max(state_diffs, default=0.0),
        "value_rel_diffs": value_diffs,
        "bitwise": ref.losses == run.losses and not any(param_diffs) and not any(state_diffs),
        "first_param_diff_step": next((i for i, d in enumerate(param_diffs) if d), None),
    }


def summary(step: ddpgraph.CapturedStep[Any]) -> dict[str, Any]:
    reason = step.reason
    return {
        "state": step.state.value,
        "code": reason.code.value if reason else None,
        "reason": reason.format() if reason else None,
        "stats": vars(step.stats),
    }


def saved(state: dict[str, Any]) -> dict[str, Any]:
    """`state` through torch.save and torch.load, as a checkpoint on disk would be."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu")  # type: ignore[no-any-return]


# ------------------------------------------------------------------ scaler
def _scaled_loop(
    info: DistInfo,
    make_scaler: Callable[[], Any],
    *,
    captured: bool,
    poison_calls: set[int],
    micro: int = 1,
):
    """Train 16 steps with a scaler; one gradient made inf on the last rank at `poison_calls`
    (counted per micro-batch backward)."""
    model = net(info)
    Poison(model, info, poison_calls, [info.world_size - 1]).grad_hook(model.fc1.weight)
    ddp = ddpgraph.prepare_ddp(model)
    opt = torch.optim.AdamW(
        ddp.parameters(), **harness.optimizer_kwargs(torch.optim.AdamW), lr=1e-2
    )
    scaler = make_scaler()

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = accumulate(
            ddp, (x, y), lambda a, b: F.cross_entropy(ddp(a), b), micro_batches=micro, scaler=scaler
        )
        scaler.step(opt)
        scaler.update()
        return loss

    if captured:
        step = ddpgraph.capture_step(
            train_step, model=ddp, optimizer=opt, scaler=scaler, backend=harness.backend()
        )
    else:
        ddpgraph.graph_safe_optimizer(opt, tensor_lr_on_cpu=True)
        step = train_step
    trace = Trajectory()
    for x, y in batches(info, 16):
        trace.add(step(x, y), ddp, opt, scale=scaler.get_scale())
    return trace, step


def scaler_agreement(info: DistInfo) -> dict[str, Any]:
    """An inf gradient on the last rank only (warm-up call 4, replay call 13): every rank
    skips, and the scale follows torch.amp.GradScaler's; with micro-batches, the inf comes
    in a micro-batch under `no_sync`."""
    out: dict[str, Any] = {}
    for name, micro, calls in (("plain", 1, {4, 13}), ("no_sync", 2, {8, 26})):
        schedule = {"init_scale": 2.0**8, "growth_interval": 3}
        ref, _ = _scaled_loop(
            info,
            lambda s=schedule: torch.amp.GradScaler("cpu", **s),
            captured=False,
            poison_calls=calls,
            micro=micro,
        )
        run, step = _scaled_loop(
            info,
            lambda s=schedule: GraphSafeGradScaler(**s),
            captured=True,
            poison_calls=calls,
            micro=micro,
        )
        out[name] = {
            **compare(ref, run),
            **summary(step),
            "scales": run.values["scale"],
            "ref_scales": ref.values["scale"],
            "params_at_end": [float(t.sum()) for t in run.params[-1]],
        }
    return out


# ------------------------------------------------------------------ accumulation
def accumulation(info: DistInfo) -> dict[str, Any]:
    """Four micro-batches per step: one all-reduce per step (counted by a DDP
    communication hook), ranks identical, captured equals eager."""

    def run(captured: bool) -> tuple[Trajectory, dict[str, Any], int]:
        ddp = ddpgraph.prepare_ddp(net(info))
        opt = torch.optim.SGD(
            ddp.parameters(), **harness.optimizer_kwargs(torch.optim.SGD), lr=0.05, momentum=0.9
        )
        calls = [0]

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations at run time
            calls[0] += 1
            tensor = bucket.buffer().div_(info.world_size)
            return (
                torch.distributed.all_reduce(tensor, async_op=True)
                .get_future()
                .then(lambda f: f.value()[0])
            )

        ddp.register_comm_hook(None, hook)

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = accumulate(ddp, (x, y), lambda a, b: F.cross_entropy(ddp(a), b), micro_batches=4)
            opt.step()
            return loss

        if captured:
            step: Any = ddpgraph.capture_step(
                train_step, model=ddp, optimizer=opt, backend=harness.backend()
            )
        else:
            ddpgraph.graph_safe_optimizer(opt, tensor_lr_on_cpu=True)
            step = train_step
        trace = Trajectory()
        for x, y in batches(info, 14, size=16):
            trace.add(step(x, y), ddp, opt)
        return trace, (summary(step) if captured else {}), calls[0]

    ref, _, ref_calls = run(False)
    trace, info_step, calls = run(True)
    return {
        **compare(ref, trace),
        **info_step,
        "allreduces_eager": ref_calls,
        "allreduces_captured": calls,
        "param_sums": [float(t.sum()) for t in trace.params[-1]],
    }


# ------------------------------------------------------------------ monitor
def watched_step(
    ddp: nn.Module, opt: torch.optim.Optimizer, poison: Poison, watch: NonFiniteMonitor
) -> Callable[..., torch.Tensor]:
    """A step whose loss `poison` may make NaN, recorded by `watch` with the gradient norm."""

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y) + poison.value()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        watch.record(loss, grad_norm=norm)
        opt.step()
        return loss.detach()

    return train_step


def run_watched(
    step: Callable[..., Any], watch: NonFiniteMonitor, data: list[Batch]
) -> dict[str, Any]:
    """Call `step` and `watch.after_step()` until the monitor raises; what it said, and the
    values it reported before."""
    logged: list[dict[str, float]] = []
    for i, (x, y) in enumerate(data):
        step(x, y)
        try:
            report = watch.after_step()
        except ddpgraph.DdpGraphError as err:
            return {
                "raised_at": i,
                "error_code": err.code.value,
                "message": str(err),
                "ranks": list(watch.nonfinite_steps[0].nonfinite_ranks),
                "logged": logged,
            }
        if report is not None:
            logged.append(report.values)
    return {"raised_at": None, "logged": logged}


def monitor(info: DistInfo) -> dict[str, Any]:
    """A NaN loss on the last rank only at call 12 (a replay): every rank raises at call
    13, naming that step and that rank."""
    model = net(info)
    poison = Poison(model, info, [12], [info.world_size - 1], value=math.nan)
    ddp = ddpgraph.prepare_ddp(model)
    opt = torch.optim.AdamW(
        ddp.parameters(), **harness.optimizer_kwargs(torch.optim.AdamW), lr=1e-2
    )
    watch = NonFiniteMonitor(action="raise")
    step = ddpgraph.capture_step(
        watched_step(ddp, opt, poison, watch), model=ddp, optimizer=opt, backend=harness.backend()
    )
    watched = run_watched(step, watch, batches(info, 16))
    return {**summary(step), **watched}


# ------------------------------------------------------------------ checkpoints
def checkpoint_resume(info: DistInfo) -> dict[str, Any]:
    """Each rank saves at step 14 (after capture); a new model, optimizer, scheduler,
    scaler and captured step built from that checkpoint (warm-up, capture, replays) train
    steps 14-29 exactly as the run that never stopped."""

    def build(seed: int) -> tuple[Any, Any, Any, Any, Any]:
        ddp = ddpgraph.prepare_ddp(net(info, dropout=0.2, norm=True))
        opt = torch.optim.AdamW(
            ddp.parameters(), **harness.optimizer_kwargs(torch.optim.AdamW), lr=1e-2
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)
        scaler = GraphSafeGradScaler(init_scale=2.0**8, growth_interval=2)

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss.detach()

        torch.manual_seed(seed + info.rank)
        step = ddpgraph.capture_step(
            train_step, model=ddp, optimizer=opt, scaler=scaler, backend=harness.backend()
        )
        return ddp, opt, sched, scaler, step

    data = batches(info, 30)

    def train(objs: tuple[Any, ...], part: list[Batch]) -> Trajectory:
        ddp, opt, sched, scaler, step = objs
        trace = Trajectory()
        for x, y in part:
            trace.add(step(x, y), ddp, opt, scale=scaler.get_scale())
            sched.step()
        return trace

    straight = build(1)
    train(straight, data[:14])
    ddp, opt, sched, scaler, _ = straight
    checkpoint = saved(training_state(model=ddp, optimizer=opt, scheduler=sched, scaler=scaler))
    rest = train(straight, data[14:])
    resumed = build(2)
    ddp2, opt2, sched2, scaler2, step2 = resumed
    load_training_state(checkpoint, model=ddp2, optimizer=opt2, scheduler=sched2, scaler=scaler2)
    again = train(resumed, data[14:])
    return {**compare(rest, again), **summary(step2)}


# ------------------------------------------------------------------ evaluation
def eval_between_steps(info: DistInfo) -> dict[str, Any]:
    """Batch-norm model, eval passes (through DDP and through the module) every 3 steps:
    captured training and evaluation equal the eager loop."""
    data = batches(info, 20)
    held_out = batches(info, 2, seed=900)

    def run(captured: bool, through_ddp: bool) -> tuple[Trajectory, list[float], dict[str, Any]]:
        ddp = ddpgraph.prepare_ddp(net(info, norm=True))
        opt = torch.optim.SGD(
            ddp.parameters(), **harness.optimizer_kwargs(torch.optim.SGD), lr=0.05, momentum=0.9
        )

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        if captured:
            step: Any = ddpgraph.capture_step(
                train_step, model=ddp, optimizer=opt, backend=harness.backend()
            )
        else:
            ddpgraph.graph_safe_optimizer(opt, tensor_lr_on_cpu=True)
            step = train_step
        evaluate = ddp if through_ddp else ddp.module
        trace, evals = Trajectory(), []
        for i, (x, y) in enumerate(data):
            trace.add(step(x, y), ddp, opt)
            if i % 3 == 2:
                ddp.eval()
                with torch.no_grad():
                    evals.extend(float(F.cross_entropy(evaluate(hx), hy)) for hx, hy in held_out)
                ddp.train()
        return trace, evals, summary(step) if captured else {}

    out: dict[str, Any] = {}
    for through_ddp in (True, False):
        ref, ref_evals, _ = run(False, through_ddp)
        trace, evals, info_step = run(True, through_ddp)
        out["ddp" if through_ddp else "module"] = {
            **compare(ref, trace),
            **info_step,
            "eval_rel_diff": harness.loss_rel_diff(ref_evals, evals),
            "evals": len(evals),
        }
    return out


REGISTRY = {
    "scaler_agreement": scaler_agreement,
    "accumulation": accumulation,
    "monitor": monitor,
    "checkpoint_resume": checkpoint_resume,
    "eval_between_steps": eval_between_steps,
}

if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor's rename
        harness.run(REGISTRY)
