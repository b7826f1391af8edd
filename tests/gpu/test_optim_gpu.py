"""The user's optimizer as written, on one GPU (world size 1, no process group needed):
capturable kernels, device tensors, checkpoints that cross devices, and the parity check.

Every captured run is compared with eager training with the same settings: the same
step run inside `GraphSafeOptimizers.installed()`, which is what `capture_step` runs
for its own eager steps. A replay launches the kernels that eager step launches, so the
comparisons are bit for bit.

Run: DDPGRAPH_GPU_WORLD=1 python -m pytest tests/gpu/test_optim_gpu.py -q -s
"""

from __future__ import annotations

import copy
import io
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddpgraph
from ddpgraph import StepState
from ddpgraph.optimizer.safe_optimizers import GraphSafeOptimizers

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda", 0)
STEPS = 14


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(DEV)


def _data(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g))
        for _ in range(n)
    ]


class Loop:
    """A model, optimizer and schedule, trained captured or eagerly with the same settings."""

    def __init__(
        self,
        make_opt: Callable[..., torch.optim.Optimizer],
        schedule: Callable[..., Any] | None = None,
    ) -> None:
        self.model = _model()
        self.opt = make_opt(self.model.parameters())
        self.sched = (
            schedule(self.opt)
            if schedule
            else torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1 / (1 + s))
        )

    def fn(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss.detach()

    def train(
        self,
        data: list[Any],
        *,
        captured: bool,
        plain: bool = False,
        before: Callable[[int], None] | None = None,
        **kw: Any,
    ) -> Any:
        """Captured, eager with the same settings, or (`plain`) ordinary eager training."""
        if captured:
            step: Any = ddpgraph.capture_step(self.fn, model=self.model, optimizer=self.opt, **kw)
        elif plain:
            step = self.fn
        else:
            safe = GraphSafeOptimizers([self.opt], DEV)
            assert safe.prepare() is None

            def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                with safe.installed():
                    return self.fn(x, y)

        self.states: list[str] = []
        for i, (x, y) in enumerate(data):
            if before is not None:
                before(i)
            step(x.to(DEV), y.to(DEV))
            self.states.append(step.state.value if captured else "eager")
            self.sched.step()
        torch.cuda.synchronize()
        return step

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _same(a: Loop, b: Loop) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.params(), b.params(), strict=True))


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def test_checkpoint_saved_during_graphed_training_steps_in_a_plain_optimizer_on_cpu() -> None:
    loop = Loop(_adamw)
    step = loop.train(_data(8), captured=True)
    assert step.state is StepState.CAPTURED
    buffer = io.BytesIO()
    torch.save(loop.opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, map_location="cpu")
    group = saved["param_groups"][0]
    assert group["capturable"] is False and type(group["lr"]) is float
    assert all(s["step"].device.type == "cpu" for s in saved["state"].values())
    cpu_model = _model().cpu()
    plain = torch.optim.AdamW(cpu_model.parameters(), lr=1.0)
    plain.load_state_dict(saved)
    F.cross_entropy(cpu_model(torch.randn(4, 32)), torch.zeros(4, dtype=torch.long)).backward()
    plain.step()  # the issue: "params, state_steps must be on supported devices"
    step.close()


@pytest.mark.parametrize("kind", ["ordinary", "graphed", "other_structure"])
def test_checkpoint_from_anywhere_continues_captured_and_equals_eager(kind: str) -> None:
    source = Loop(
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, amsgrad=kind == "other_structure")
    )
    source.train(_data(6), captured=kind == "graphed", plain=kind != "graphed")
    saved = copy.deepcopy(source.opt.state_dict())

    def load(loop: Loop) -> Callable[[int], None]:
        return lambda i: loop.opt.load_state_dict(copy.deepcopy(saved)) if i == 7 else None

    ref, run = Loop(_adamw), Loop(_adamw)
    ref.train(_data(), captured=False, before=load(ref))
    step = run.train(_data(), captured=True, before=load(run))
    assert step.reason is None, step.reason
    expected_captures = 2 if kind == "other_structure" else 1
    assert step.stats.captures == expected_captures and run.states[-1] == "captured", run.states
    assert _same(ref, run)
    step.close()


def test_nadam_that_stepped_eagerly_before_capture_step_captures() -> None:
    def nadam(params: Any) -> torch.optim.Optimizer:
        return torch.optim.NAdam(params, lr=1e-3)

    ref, run = Loop(nadam), Loop(nadam)
    for loop in (ref, run):
        for x, y in _data(3):  # plain eager steps: mu_product and step live on the CPU
            loop.fn(x.to(DEV), y.to(DEV))
        assert next(iter(loop.opt.state.values()))["mu_product"].device.type == "cpu"
    ref.train(_data(), captured=False)
    step = run.train(_data(), captured=True)
    assert step.reason is None and run.states[-1] == "captured", step.reason
    assert _same(ref, run)
    step.close()
    # Given back as the plain NAdam keeps it.
    assert next(iter(run.opt.state.values()))["mu_product"].device.type == "cpu"


def test_close_leaves_the_optimizer_as_given() -> None:
    loop = Loop(_adamw)
    given = copy.deepcopy(
        [{k: v for k, v in g.items() if k != "params"} for g in loop.opt.param_groups]
    )
    defaults = copy.deepcopy(loop.opt.defaults)
    step = loop.train(_data(8), captured=True)
    assert step.state is StepState.CAPTURED
    assert all(type(lr) is float for lr in loop.sched.get_last_lr())
    step.close()
    now = [{k: v for k, v in g.items() if k != "params"} for g in loop.opt.param_groups]
    given[0]["lr"] = loop.sched.get_last_lr()[0]
    assert now == given and loop.opt.defaults == defaults
    assert all(s["step"].device.type == "cpu" for s in loop.opt.state.values())


def test_parity_check_passes_bit_for_bit_and_its_cost() -> None:
    loop = Loop(_adamw)
    torch.cuda.synchronize()
    start = time.perf_counter()
    step = loop.train(_data(5), captured=True, parity=True)
    elapsed = time.perf_counter() - start
    assert step.state is StepState.CAPTURED and step.reason is None, step.reason
    print(f"5 calls with the parity check at capture: {elapsed * 1e3:.1f} ms")
    step.close()


def test_per_replay_cost_of_the_mirrored_hyperparameters() -> None:
    """Printed, never asserted: the host time `before_replay` adds to each replay."""
    loop = Loop(_adamw)
    step = loop.train(_data(5), captured=True)
    safe = step._optim  # the step's GraphSafeOptimizers
    for n_changed in (0, 1):
        start = time.perf_counter()
        for i in range(2000):
            if n_changed:
                loop.opt.param_groups[0]["lr"] = 1e-3 * (1 + i % 2)
            assert safe.before_replay() is None
        per = (time.perf_counter() - start) / 2000
        # A warning, so that the number reaches the run's summary without `-s`.
        warnings.warn(
            f"before_replay, {n_changed} value(s) changed: {per * 1e6:.2f} us", stacklevel=1
        )
    # What a scheduler cost per step when the lr was a device tensor in the param group
    # (it filled that tensor itself): the part of the 1-changed cost that is not new.
    lr = torch.zeros((), device=DEV)
    start = time.perf_counter()
    for i in range(2000):
        lr.fill_(1e-3 * (1 + i % 2))
    warnings.warn(
        f"a device tensor's fill_: {(time.perf_counter() - start) / 2000 * 1e6:.2f} us",
        stacklevel=1,
    )
    step.close()


def _llama_run(captured: bool, bf16: bool) -> list[torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
        intermediate_size=688,
        max_position_embeddings=128,
    )
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12)

    def fn(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach()

    g = torch.Generator().manual_seed(5)
    data = [(torch.randint(0, 4096, (4, 128), generator=g),) for _ in range(12)]
    if captured:
        step: Any = ddpgraph.capture_step(fn, model=model, optimizer=opt)
    else:
        safe = GraphSafeOptimizers([opt], DEV)
        assert safe.prepare() is None

        def step(x: torch.Tensor) -> torch.Tensor:
            with safe.installed():
                return fn(x)

    for (x,) in data:
        step(x.to(DEV))
        sched.step()
    if captured:
        assert step.state is StepState.CAPTURED, step.reason
        step.close()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
def test_transformers_llama_captured_equals_eager_bit_for_bit(bf16: bool) -> None:
    """transformers builds another causal mask while a stream captures; the recording takes
    the eager branch (`ddpgraph.step.same_path`), so the graph runs the eager kernels."""
    eager, graphed = _llama_run(False, bf16), _llama_run(True, bf16)
    worst = max(float((a - b).abs().max()) for a, b in zip(eager, graphed, strict=True))
    print(f"Llama {'bf16' if bf16 else 'fp32'}: largest parameter difference {worst:.3g}")
    assert worst == 0.0
