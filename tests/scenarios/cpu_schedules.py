"""Learning-rate and momentum schedules across processes (gloo, CPU, both CPU backends):
every hyper-parameter a schedule changes stays live in the graph on every rank.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/scenarios/cpu_schedules.py --out DIR adamw_one_cycle recording:adamw_one_cycle ...

Each scenario trains the same DDP model from the same state and data twice, through
`capture_step` and eagerly with the same settings (`harness.with_same_settings`), with
the optimizer as a user writes it (no `fused=` for the CPU: the recording backend's
graph-safe mode is found by ddpgraph), the schedule stepped after each call, and a
DataLoader feeding the loop where a user would have one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import harness
import torch
import torch.nn.functional as F
from cpu_training import batches, net
from torch.optim import lr_scheduler as lrs
from torch.utils.data import DataLoader, TensorDataset

import ddpgraph
from ddpgraph.ddp.distributed import DistInfo

STEPS = 20
Schedule = Callable[[torch.optim.Optimizer], Any]


def _one_cycle(opt: torch.optim.Optimizer) -> Any:
    return lrs.OneCycleLR(
        opt, max_lr=0.05, total_steps=STEPS + 5
    )  # cycle_momentum=True, its default


def _cyclic(opt: torch.optim.Optimizer) -> Any:
    return lrs.CyclicLR(opt, base_lr=0.001, max_lr=0.05, step_size_up=4)  # cycle_momentum=True


def _chained(opt: torch.optim.Optimizer) -> Any:
    return lrs.ChainedScheduler([lrs.LinearLR(opt, start_factor=0.5, total_iters=6), _cyclic(opt)])


def _sequential(opt: torch.optim.Optimizer) -> Any:
    warmup = lrs.LinearLR(opt, start_factor=0.1, total_iters=5)
    return lrs.SequentialLR(opt, [warmup, lrs.CosineAnnealingLR(opt, T_max=STEPS)], milestones=[5])


def _plateau(opt: torch.optim.Optimizer) -> Any:
    # A threshold no loss meets: the rate is cut every other step, after capture too.
    return lrs.ReduceLROnPlateau(opt, factor=0.5, patience=1, threshold=0.9)


def _hf_cosine(opt: torch.optim.Optimizer) -> Any:
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(opt, num_warmup_steps=4, num_training_steps=STEPS)


def _hf_linear(opt: torch.optim.Optimizer) -> Any:
    from transformers import get_linear_schedule_with_warmup

    return get_linear_schedule_with_warmup(opt, num_warmup_steps=4, num_training_steps=STEPS)


class Loop:
    """A DDP model, its optimizer and schedule, and the loop that trains them."""

    def __init__(
        self,
        info: DistInfo,
        make_opt: Callable[..., torch.optim.Optimizer],
        schedule: Schedule,
        *,
        gpt: bool,
        micro: int,
        before: Callable[[int, torch.optim.Optimizer], None] | None,
    ) -> None:
        self.info, self.gpt, self.micro, self.before = info, gpt, micro, before
        self.ddp = ddpgraph.prepare_ddp(_gpt(info) if gpt else net(info, dropout=0.1))
        self.opt = make_opt(self.ddp.parameters())
        self.sched = schedule(self.opt)
        self.live: list[Any] = []  # every hyper-parameter the schedule set, per step

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.gpt:
            return self.ddp(input_ids=x, labels=x).loss  # type: ignore[no-any-return]
        return F.cross_entropy(self.ddp(x), y)

    def fn(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        if self.micro > 1:
            loss = ddpgraph.accumulate(self.ddp, (x, y), self.loss, micro_batches=self.micro)
        else:
            loss = self.loss(x, y)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), 1.0)
        self.opt.step()
        return loss.detach()

    def train(self, call: Callable[..., torch.Tensor]) -> tuple[list[str], list[float]]:
        states, losses = [], []
        torch.manual_seed(1 + self.info.rank)  # the same dropout masks in both runs
        for i, (x, y) in enumerate(_loader(self.info, gpt=self.gpt)):
            if self.before is not None:
                self.before(i, self.opt)
            loss = float(call(x, y))  # read now: a replay overwrites it
            losses.append(loss)
            state = getattr(call, "state", None)
            states.append(state.value if state is not None else "eager")
            if isinstance(self.sched, lrs.ReduceLROnPlateau):
                self.sched.step(loss)
            else:
                self.sched.step()
            group = self.opt.param_groups[0]
            self.live.append((group["lr"], group.get("betas"), group.get("momentum")))
        return states, losses

    def params(self) -> list[torch.Tensor]:
        return harness.params_of(self.ddp)


def _gpt(info: DistInfo) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg).to(info.device)


def _loader(info: DistInfo, *, gpt: bool) -> Any:
    if not gpt:
        return batches(info, STEPS)
    # Token batches from a DataLoader with a worker process, as a language-model loop has.
    gen = torch.Generator().manual_seed(100 + info.rank)
    tokens = torch.randint(0, 64, (STEPS * 4, 16), generator=gen)
    data = TensorDataset(tokens, tokens)
    return DataLoader(data, batch_size=4, num_workers=1, drop_last=True)


def _compare(
    info: DistInfo,
    make_opt: Callable[..., torch.optim.Optimizer],
    schedule: Schedule,
    *,
    gpt: bool = False,
    micro: int = 1,
    before: Callable[[int, torch.optim.Optimizer], None] | None = None,
    **capture_kw: Any,
) -> dict[str, Any]:
    ref = Loop(info, make_opt, schedule, gpt=gpt, micro=micro, before=before)
    _, ref_losses = ref.train(harness.with_same_settings(ref.opt, ref.fn, info.device))
    run = Loop(info, make_opt, schedule, gpt=gpt, micro=micro, before=before)
    with ddpgraph.capture_step(
        run.fn, model=run.ddp, optimizer=run.opt, backend=harness.backend(), **capture_kw
    ) as step:
        states, losses = run.train(step)
        reason = step.reason
        stats = step.stats
    return {
        "states": states,
        "code": reason.code.value if reason else None,
        "captures": stats.captures,
        "replays": stats.replays,
        "param_rel_diff": harness.rel_diff(ref.params(), run.params()),
        "loss_rel_diff": harness.loss_rel_diff(ref_losses, losses),
        "param_sum": float(sum(p.double().sum() for p in run.params())),
        # How many different values the schedule gave each hyper-parameter after capture.
        "distinct_after_capture": [len({repr(v[i]) for v in run.live[11:]}) for i in range(3)],
        "user_values_are_numbers": all(_numbers(v) for v in run.live),
    }


def _numbers(values: Any) -> bool:
    """Python numbers only (or None): what the user's param groups hold between calls."""
    if isinstance(values, (tuple, list)):
        return all(_numbers(v) for v in values)
    return values is None or isinstance(values, (int, float))


def _momentum_at_14(i: int, opt: torch.optim.Optimizer) -> None:
    if i == 14:  # a hand-written change after capture, on every rank
        opt.param_groups[0]["momentum"] = 0.5


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


REGISTRY: dict[str, Callable[[DistInfo], dict[str, Any]]] = {
    "adamw_one_cycle": lambda info: _compare(info, _adamw, _one_cycle),
    "adam_cyclic": lambda info: _compare(
        info, lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True), _cyclic
    ),
    "sgd_nesterov_cyclic_accumulated": lambda info: _compare(
        info,
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-4),
        _cyclic,
        micro=2,
    ),
    "sgd_chained": lambda info: _compare(
        info, lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, dampening=0.1), _chained
    ),
    "adamw_sequential": lambda info: _compare(info, _adamw, _sequential),
    "adamw_plateau": lambda info: _compare(info, _adamw, _plateau),
    "gpt2_hf_cosine": lambda info: _compare(info, _adamw, _hf_cosine, gpt=True),
    "gpt2_hf_linear": lambda info: _compare(info, _adamw, _hf_linear, gpt=True),
    # Agreed every 4 calls: the ranks capture again together at call 16 (0-based 15).
    "sgd_momentum_set_after_capture": lambda info: _compare(
        info,
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
        lambda o: lrs.LambdaLR(o, lambda s: 1 / (1 + 0.1 * s)),
        before=_momentum_at_14,
        agree_every=4,
    ),
}

if __name__ == "__main__":
    harness.run(REGISTRY)
