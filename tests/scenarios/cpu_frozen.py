"""Frozen Python values across processes on CPU (gloo), with both CPU graph backends.

Steps whose Python computes a value that changes from call to call (a counter, a ramp,
a global the loop sets, a flag flipped after capture), each trained through
`capture_step` and as the same loop run eagerly with the optimizer's graph-safe mode
(`harness.with_same_settings`), and steps that must stay captured: real models built
from their libraries' configurations, dropout, clipping, bf16 autocast, accumulation,
loss scaling, a pinned multi-worker DataLoader. (A step that changes Python state outside
it, which it never passes to torch, is refused: `history`; so is a tensor it rebinds from
itself: `running_average`.)
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any

import harness
import torch
import torch.nn.functional as F
from torch import nn

import ddpgraph
from ddpgraph.ddp.distributed import DistInfo
from ddpgraph.training.accumulate import accumulate
from ddpgraph.training.scaler import GraphSafeGradScaler

CALLS = 30
Batch = tuple[torch.Tensor, torch.Tensor]
LossOf = Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor]
LOSS_WEIGHT = 1.0  # a global the training loop changes (`weight_from_global`)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _graph_backend() -> Any:
    """CUDA graphs on a GPU (tests/scenarios/gpu_frozen.py), else the variant's CPU backend."""
    return None if torch.cuda.is_available() else harness.backend()


def _on(info: DistInfo, batches: list[Batch]) -> list[Batch]:
    return [(x.to(info.device), y.to(info.device)) for x, y in batches]


def _batches(info: DistInfo, n: int = CALLS) -> list[Batch]:
    gen = torch.Generator().manual_seed(100 + info.rank)
    return [
        (torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen))
        for _ in range(n)
    ]


def _train(
    info: DistInfo,
    loss_of: LossOf,
    *,
    captured: bool,
    before_call: Callable[[int, dict[str, Any]], None] | None = None,
    **capture: Any,
) -> dict[str, Any]:
    """`CALLS` calls of a step whose loss is `loss_of(output, target, state)`, captured
    or eager; `before_call(i, state)` is the loop's own code before call i (1-based)."""
    ddp = ddpgraph.prepare_ddp(_model().to(info.device))
    opt = torch.optim.AdamW(
        ddp.parameters(), lr=1e-2, **harness.optimizer_kwargs(torch.optim.AdamW)
    )
    state: dict[str, Any] = {"count": 0}

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(ddp(x), y, state)
        loss.backward()
        opt.step()
        return loss.detach()

    step: Any = (
        ddpgraph.capture_step(fn, model=ddp, optimizer=opt, backend=_graph_backend(), **capture)
        if captured
        else harness.with_same_settings(opt, fn, info.device)
    )
    losses, states = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(_on(info, _batches(info)), start=1):
            if before_call is not None:
                before_call(i, state)
            losses.append(float(step(x, y)))
            states.append(step.state.value if captured else "eager")
    out: dict[str, Any] = {
        "losses": losses,
        "params": harness.params_of(ddp),
        "count": state["count"],
        "states": states,
    }
    if captured:
        out.update(_summary(step))
        out["warnings"] = [
            str(w.message) for w in caught if "FROZEN_PYTHON_VALUE" in str(w.message)
        ]
        step.close()
    return out


def _summary(step: Any) -> dict[str, Any]:
    reason = step.reason
    where = reason.location if reason else None
    return {
        "state": step.state.value,
        "code": reason.code.value if reason else None,
        "line": [where.lineno, where.source] if where else None,
        "ranks": list(reason.ranks) if reason else [],
        "reason": reason.format() if reason else None,
        "findings": [f.code.value for f in step.findings],
        "finding_lines": [f.location.source if f.location else None for f in step.findings],
        "stats": vars(step.stats),
    }


def _against_eager(
    info: DistInfo, loss_of: LossOf, before_call: Any = None, **capture: Any
) -> dict[str, Any]:
    ref = _train(info, loss_of, captured=False, before_call=before_call)
    run = _train(info, loss_of, captured=True, before_call=before_call, **capture)
    run["loss_rel_diff"] = harness.loss_rel_diff(ref["losses"], run["losses"])
    run["param_rel_diff"] = harness.rel_diff(ref["params"], run["params"])
    run["eager_count"] = ref["count"]
    del run["params"]
    return run


# ------------------------------------------------------------------ values that change
def counter(info: DistInfo) -> dict[str, Any]:
    def loss_of(out: torch.Tensor, y: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        state["count"] += 1
        scale = 1.0 / state["count"]
        return F.cross_entropy(out, y) * scale  # frozen: counter

    return _against_eager(info, loss_of)


def ramp(info: DistInfo) -> dict[str, Any]:
    def loss_of(out: torch.Tensor, y: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        state["count"] += 1
        ramp = min(1.0, state["count"] / 50)
        return F.cross_entropy(out, y) + ramp * out.pow(2).mean()  # frozen: ramp

    return _against_eager(info, loss_of)


def _anneal_global(i: int, state: dict[str, Any]) -> None:
    global LOSS_WEIGHT
    LOSS_WEIGHT = 0.98**i


def weight_from_global(info: DistInfo) -> dict[str, Any]:
    def loss_of(out: torch.Tensor, y: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        return F.cross_entropy(out, y) * LOSS_WEIGHT  # frozen: global

    return _against_eager(info, loss_of, _anneal_global)


def _flagged_loss(out: torch.Tensor, y: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    loss = F.cross_entropy(out, y)
    if state.get("aux"):
        loss = loss + 0.5 * out.pow(2).mean()  # frozen: flag
    return loss


FLIP_AT = 20  # a check call with verify_every=2 (capture at call 12)


def _flip(ranks: Callable[[int], bool]) -> Callable[[int, dict[str, Any]], None]:
    def before_call(i: int, state: dict[str, Any]) -> None:
        if i == FLIP_AT and ranks(torch.distributed.get_rank()):
            state["aux"] = True

    return before_call


def flag_after_capture(info: DistInfo) -> dict[str, Any]:
    """The flag flips on the 20th call, a check call: every later call follows it."""
    return _against_eager(info, _flagged_loss, _flip(lambda rank: True), verify_every=2)


def flag_after_capture_unchecked(info: DistInfo) -> dict[str, Any]:
    """The same without `verify_every`: the graph keeps the flag it recorded."""
    return _against_eager(info, _flagged_loss, _flip(lambda rank: True))


AUX_ON = False  # a module-level flag the loop sets (`global_flag_after_capture`)


def _globally_flagged_loss(
    out: torch.Tensor, y: torch.Tensor, state: dict[str, Any]
) -> torch.Tensor:
    loss = F.cross_entropy(out, y)
    if AUX_ON:  # frozen: global flag
        loss = loss + 0.5 * out.pow(2).mean()
    return loss


def _set_global_flag(i: int, state: dict[str, Any]) -> None:
    global AUX_ON
    AUX_ON = i >= FLIP_AT


def global_flag_after_capture(info: DistInfo) -> dict[str, Any]:
    """A module-level flag the loop sets on the 20th call, without `verify_every`: the
    step reads it, so every call from then on runs eagerly and follows it."""
    return _against_eager(info, _globally_flagged_loss, _set_global_flag)


# A config object of the script's, read by the step and changed by the loop
# (`config_after_capture`).
CFG = types.SimpleNamespace(aux_weight=0.0)


def _configured_loss(out: torch.Tensor, y: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    return F.cross_entropy(out, y) + CFG.aux_weight * out.pow(2).mean()  # frozen: config


def _set_config(i: int, state: dict[str, Any]) -> None:
    CFG.aux_weight = 0.5 if i >= FLIP_AT else 0.0


def config_after_capture(info: DistInfo) -> dict[str, Any]:
    """An attribute of a config object (`CFG.aux_weight`) the loop sets on the 20th call,
    without `verify_every`: every call from then on runs eagerly and follows it."""
    return _against_eager(info, _configured_loss, _set_config)


def flag_on_one_rank(info: DistInfo) -> dict[str, Any]:
    """The flag flips on the last rank only: every rank captures again, on one call."""
    last = info.world_size - 1
    return _against_eager(info, _flagged_loss, _flip(lambda rank: rank == last), verify_every=2)


def counter_after_capture(info: DistInfo) -> dict[str, Any]:
    """A value that starts changing only after capture: the check finds it, and the new
    warm-up refuses it (it keeps changing)."""

    def loss_of(out: torch.Tensor, y: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        decay = 1.0 if state["call"] < FLIP_AT else 0.9 ** (state["call"] - FLIP_AT)
        return F.cross_entropy(out, y) * decay  # frozen: decay

    def before_call(i: int, state: dict[str, Any]) -> None:
        state["call"] = i  # the loop's own count, read by the step

    return _against_eager(info, loss_of, before_call, verify_every=2)


def history(info: DistInfo) -> dict[str, Any]:
    """Python state outside the step that it never passes to torch, changed on every call
    (a count here; a loss history alike): replays would stop changing it."""

    def loss_of(out: torch.Tensor, y: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        state["count"] += 1  # frozen: history
        return F.cross_entropy(out, y)

    return _against_eager(info, loss_of)


def running_average(info: DistInfo) -> dict[str, Any]:
    """A tensor outside the step that it reads and rebinds on every call (a running
    average of the loss): replays would read the captured tensor, and it would stop
    moving."""

    def loss_of(out: torch.Tensor, y: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        loss = F.cross_entropy(out, y)
        average = state.setdefault("average", torch.zeros((), device=loss.device))
        state["average"] = average * 0.9 + loss.detach() * 0.1  # frozen: average
        return loss

    return _against_eager(info, loss_of)


# ------------------------------------------------------------------ steps that must stay captured
def _clean(
    info: DistInfo,
    make_model: Callable[[], nn.Module],
    data: list[Any],
    step_of: Callable[..., Any],
    *,
    opt_cls: Any = torch.optim.AdamW,
    opt_kw: dict[str, Any] | None = None,
    reference: bool = False,
) -> dict[str, Any]:
    """Train on `data` with a scheduler, captured with a check every 4 calls (and, with
    `reference`, eagerly too, to compare)."""

    def train(captured: bool) -> tuple[dict[str, Any], list[torch.Tensor]]:
        ddp = ddpgraph.prepare_ddp(make_model().to(info.device))
        opt = opt_cls(
            ddp.parameters(), lr=1e-3, **harness.optimizer_kwargs(opt_cls), **(opt_kw or {})
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
        made = step_of(ddp, opt)
        fn, options = (made, {}) if callable(made) else made
        torch.manual_seed(1)  # dropout draws alike in both runs
        if not captured:
            step = harness.with_same_settings(opt, fn, info.device)
            for batch in data:
                step(*batch)
                sched.step()
            return {}, harness.params_of(ddp)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ddpgraph.capture_step(
                fn, model=ddp, optimizer=opt, backend=_graph_backend(), verify_every=4, **options
            ) as step:
                for batch in data:
                    step(*batch)
                    sched.step()
                out = _summary(step)
        out["warnings"] = [
            str(w.message) for w in caught if "FROZEN_PYTHON_VALUE" in str(w.message)
        ]
        return out, harness.params_of(ddp)

    out, params = train(True)
    if reference:
        out["param_rel_diff"] = harness.rel_diff(train(False)[1], params)
    return out


def _plain_step(
    ddp: nn.Module, opt: torch.optim.Optimizer, *, clip: bool = True, autocast: bool = False
) -> Callable[..., torch.Tensor]:
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = ddp(x)
            loss = F.cross_entropy(logits.float().flatten(0, -2), y.flatten())
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        return loss.detach()

    return train_step


def _tokens(info: DistInfo, vocab: int, n: int = 20, t: int = 16) -> list[Batch]:
    gen = torch.Generator().manual_seed(7 + info.rank)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, t + 1), generator=gen)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return _on(info, out)


def clean_demo_gpt(info: DistInfo) -> dict[str, Any]:
    from ddpgraph.app.models import GPTConfig, TinyGPT

    return _clean(
        info,
        lambda: _seeded(TinyGPT, GPTConfig(vocab=128, block=16, layers=2, dim=32, heads=2)),
        _tokens(info, 128),
        lambda d, o: _plain_step(d, o, autocast=True),
    )


def _seeded(cls: Callable[..., nn.Module], *args: Any) -> nn.Module:
    torch.manual_seed(0)
    return cls(*args)


def _attention(info: DistInfo) -> str:
    """On CPU the models are built with eager attention: sdpa's mask and the search for
    packed sequences read tensors on the host, which a recording refuses (on a GPU,
    transformers skips them while a graph records). On a GPU, sdpa: eager attention's mask
    building copies a Python number to the device, which waits for the host (the probe
    refuses it, naming `attn_implementation="sdpa"`)."""
    return "eager" if info.device.type == "cpu" else "sdpa"


class _Logits(nn.Module):
    """A transformers causal LM on token ids, with a mask."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # With a mask, transformers looks for packed sequences in no host read.
        return self.model(
            input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False
        ).logits


_TINY_GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 32}


def clean_hf_gpt2(info: DistInfo) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(**_TINY_GPT2, attn_implementation=_attention(info))
    return _clean(
        info, lambda: _Logits(_seeded(GPT2LMHeadModel, config)), _tokens(info, 128), _plain_step
    )


def clean_hf_llama(info: DistInfo) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=32,
        attn_implementation=_attention(info),
    )
    return _clean(
        info,
        lambda: _Logits(_seeded(LlamaForCausalLM, config)),
        _tokens(info, 128),
        lambda d, o: _plain_step(d, o, autocast=True),
    )


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def _images(info: DistInfo, n: int = 20) -> list[Batch]:
    gen = torch.Generator().manual_seed(3 + info.rank)
    return _on(
        info,
        [
            (torch.randn(4, 3, 12, 12, generator=gen), torch.randint(0, 4, (4,), generator=gen))
            for _ in range(n)
        ],
    )


def clean_cnn_sgd(info: DistInfo) -> dict[str, Any]:
    def make(ddp: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., torch.Tensor]:
        return _plain_step(ddp, opt)

    return _clean(
        info,
        _cnn,
        _images(info),
        make,
        opt_cls=torch.optim.SGD,
        opt_kw={"momentum": 0.9},
        reference=True,
    )


def clean_accumulate_scaler(info: DistInfo) -> dict[str, Any]:
    """Accumulation over micro-batches and the graph-safe loss scaler, fed by a pinned
    DataLoader with worker processes."""
    scaler = GraphSafeGradScaler(init_scale=2.0**8, growth_interval=2)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(
            *[torch.cat(t) for t in zip(*_batches(info, 20), strict=True)]
        ),
        batch_size=8,
        num_workers=2,
        pin_memory=True,
        drop_last=True,
    )

    def make(
        ddp: nn.Module, opt: torch.optim.Optimizer
    ) -> tuple[Callable[..., torch.Tensor], dict[str, Any]]:
        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = accumulate(
                ddp, (x, y), lambda a, b: F.cross_entropy(ddp(a), b), micro_batches=2, scaler=scaler
            )
            scaler.step(opt)
            scaler.update()
            return loss.detach()

        return train_step, {"scaler": scaler}

    return _clean(info, _model, list(loader), make)


SCENARIOS = {
    f.__name__: f
    for f in (
        counter,
        ramp,
        weight_from_global,
        flag_after_capture,
        flag_after_capture_unchecked,
        global_flag_after_capture,
        config_after_capture,
        flag_on_one_rank,
        counter_after_capture,
        history,
        running_average,
        clean_demo_gpt,
        clean_hf_gpt2,
        clean_hf_llama,
        clean_cnn_sgd,
        clean_accumulate_scaler,
    )
}
REGISTRY = SCENARIOS  # the name together.py reads

if __name__ == "__main__":
    harness.run(SCENARIOS)
