"""The optimizer as written, checkpoints and the parity check across processes (gloo, CPU,
stand-in backend): decisions one rank's data could make alone are taken by every rank.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/scenarios/cpu_optim.py --out DIR parity_mismatch_on_one_rank ...
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import harness
import torch
import torch.nn.functional as F
from cpu_training import batches, net

import ddpgraph
from ddpgraph import ParityCheck
from ddpgraph.ddp.distributed import DistInfo
from ddpgraph.optimizer.safe_optimizers import GraphSafeOptimizers
from perturbed import FirstReplayPerturbed

STEPS = 16


class Loop:
    """DDP, AdamW and a schedule; `call` is the captured step or the eager one with the
    same graph-safe settings."""

    def __init__(self, info: DistInfo, *, amsgrad: bool = False) -> None:
        self.info = info
        self.ddp = ddpgraph.prepare_ddp(net(info))
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=1e-2, amsgrad=amsgrad)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1 / (1 + 0.1 * s))

    def fn(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.ddp(x), y)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def eager(self) -> Callable[..., torch.Tensor]:
        safe = GraphSafeOptimizers([self.opt], self.info.device)
        assert safe.prepare() is None

        def call(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with safe.installed():
                return self.fn(x, y)

        return call

    def train(
        self, call: Callable[..., Any], before: Callable[[int], None] | None = None
    ) -> list[str]:
        states = []
        for i, (x, y) in enumerate(batches(self.info, STEPS)):
            if before is not None:
                before(i)
            call(x, y)
            state = getattr(call, "state", None)
            states.append(state.value if state is not None else "eager")
            self.sched.step()
        return states

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.ddp.parameters()]


def _capture(loop: Loop, backend: Any = None, **kw: Any) -> ddpgraph.CapturedStep[torch.Tensor]:
    backend = backend or ddpgraph.PassThroughBackend()
    return ddpgraph.capture_step(loop.fn, model=loop.ddp, optimizer=loop.opt, backend=backend, **kw)


def _result(
    step: ddpgraph.CapturedStep[Any], states: list[str], ref: Loop, run: Loop
) -> dict[str, Any]:
    reason = step.reason
    return {
        "states": states,
        "captures": step.stats.captures,
        "code": reason.code.value if reason else None,
        "finding_ranks": [list(f.ranks) for f in step.findings],
        "param_rel_diff": harness.rel_diff(ref.params(), run.params()),
        "param_sum": float(sum(p.double().sum() for p in run.params())),
    }


def parity_mismatch_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """Rank 1's first replay (call 14: 11 warm-up, the recording, the check's eager step)
    computes something else: every rank gives the graph up at that call."""
    ref, run = Loop(info), Loop(info)
    ref.train(ref.eager())
    backend = FirstReplayPerturbed(run.ddp, 1e-3, perturbs=info.rank == 1)
    step = _capture(run, backend, parity=ParityCheck(rtol=1e-6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        states = run.train(step)
    return _result(step, states, ref, run)


def parity_passes(info: DistInfo) -> dict[str, Any]:
    ref, run = Loop(info), Loop(info)
    ref.train(ref.eager())
    step = _capture(run, parity=True)
    return _result(step, run.train(step), ref, run)


def checkpoint_of_another_structure(info: DistInfo) -> dict[str, Any]:
    """Every rank loads an AMSGrad checkpoint after capture: every rank captures again at
    the same call, and training equals eager training that loaded it."""
    source = Loop(info, amsgrad=True)
    source.train(source.eager())
    saved = copy.deepcopy(source.opt.state_dict())

    def load(loop: Loop) -> Callable[[int], None]:
        return lambda i: loop.opt.load_state_dict(copy.deepcopy(saved)) if i == 13 else None

    ref, run = Loop(info), Loop(info)
    ref.train(ref.eager(), load(ref))
    # Agreeing on every call: the ranks capture again at the call after the load.
    step = _capture(run, agree_every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        states = run.train(step, load(run))
    return _result(step, states, ref, run)


REGISTRY: dict[str, Callable[[DistInfo], dict[str, Any]]] = {
    "parity_mismatch_on_one_rank": parity_mismatch_on_one_rank,
    "parity_passes": parity_passes,
    "checkpoint_of_another_structure": checkpoint_of_another_structure,
}

if __name__ == "__main__":
    harness.run(REGISTRY)
