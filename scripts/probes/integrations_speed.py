"""Milliseconds per training step, eager and captured, for DDP built the three ways users
build it: `DDP(...)` by hand, PyTorch Lightning's `Trainer(strategy="ddp")`, and Hugging
Face Accelerate's `accelerator.prepare(...)`. GPU only.

    python scripts/probes/integrations_speed.py                       # one GPU
    torchrun --nproc_per_node=2 scripts/probes/integrations_speed.py  # two

Models: ddpgraph's demo TinyGPT (T=128, vocab 1000), and a transformers GPT-2 (6 layers,
d=384, T=256, vocab 8192) built from a config when transformers is installed. Batch 8 per
GPU, bf16 autocast, AdamW. The eager runs use the same graph-safe optimizer as the
captured ones. Prints one table on rank 0; a run whose step was not captured says why
instead of a speedup.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpgraph
from ddpgraph.app.models import GPTConfig, TinyGPT
from ddpgraph.ddp.distributed import DistInfo, shutdown

STEPS, TIMED, BATCH = 60, 40, 8
Model = tuple[Callable[[], nn.Module], int, int]  # factory, vocabulary, sequence length


class GPT2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=6, n_embd=384, n_head=6, vocab_size=8192, n_positions=256)
        self.lm = GPT2LMHeadModel(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=x).logits


def _models() -> dict[str, Model]:
    tiny = GPTConfig()
    found: dict[str, Model] = {"tinygpt": (TinyGPT, tiny.vocab, tiny.block)}
    try:
        import transformers  # noqa: F401

        found["gpt2"] = (GPT2, 8192, 256)
    except ImportError:
        pass
    return found


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def _data(info: DistInfo, model: Model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    _, vocab, length = model
    gen = torch.Generator().manual_seed(info.rank)
    seqs = [torch.randint(0, vocab, (BATCH, length + 1), generator=gen) for _ in range(STEPS)]
    return [(s[:, :-1].to(info.device), s[:, 1:].to(info.device)) for s in seqs]


def _timed(run_step: Callable[[Any, Any], Any], data: list[Any]) -> float:
    for x, y in data[: STEPS - TIMED]:
        run_step(x, y)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for x, y in data[STEPS - TIMED :]:
        run_step(x, y)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / TIMED


def plain(info: DistInfo, model: Model, captured: bool) -> tuple[float, str]:
    torch.manual_seed(0)
    ddp = DDP(model[0]().to(info.device), device_ids=[info.device.index])
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = _loss(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return _run(info, train_step, ddp, opt, captured, _data(info, model))


def accelerate(info: DistInfo, model: Model, captured: bool) -> tuple[float, str]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    accelerator = Accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    net = model[0]()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-4)
    net, opt = accelerator.prepare(net, opt)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = _loss(net(x), y)
        accelerator.backward(loss)
        opt.step()
        return loss.detach()

    return _run(info, train_step, net, opt, captured, _data(info, model))


def _run(
    info: DistInfo,
    train_step: Callable[..., Any],
    model: nn.Module,
    opt: Any,
    captured: bool,
    data: list[Any],
) -> tuple[float, str]:
    if not captured:
        ddpgraph.graph_safe_optimizer(getattr(opt, "optimizer", opt))
        return _timed(train_step, data), ""
    with ddpgraph.capture_step(train_step, model=model, optimizer=opt) as step:
        ms = _timed(step, data)
        note = (
            ""
            if step.state is ddpgraph.StepState.CAPTURED
            else (step.reason.code.value if step.reason else step.state.value)
        )
    return ms, note


def lightning(info: DistInfo, model: Model, captured: bool) -> tuple[float, str]:
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from ddpgraph.integrations.lightning import CUDAGraphCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = model[0]()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = _loss(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.times: dict[int, float] = {}

        def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            if not captured:
                ddpgraph.graph_safe_optimizer(trainer.optimizers[0])

        def on_train_batch_start(
            self, trainer: L.Trainer, module: L.LightningModule, batch: Any, i: int
        ) -> None:
            if i in (STEPS - TIMED, STEPS - 1):
                torch.cuda.synchronize()
                self.times[i] = time.perf_counter()

    data = [(x.cpu(), y.cpu()) for x, y in _data(info, model)]
    loader = DataLoader(data, batch_size=None)
    graphs = CUDAGraphCallback()
    clock = Clock()
    trainer = L.Trainer(
        accelerator="gpu",
        devices=info.world_size,
        strategy="ddp",
        max_epochs=1,
        precision="bf16-mixed",
        callbacks=[clock, *([graphs] if captured else [])],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(Module(), loader)
    ms = (clock.times[STEPS - 1] - clock.times[STEPS - TIMED]) * 1000 / (TIMED - 1)
    note = (
        ""
        if not captured or graphs.state == "captured"
        else (graphs.reason.code.value if graphs.reason else graphs.state)
    )
    return ms, note


def main() -> None:
    if not torch.cuda.is_available():
        print("SKIP: this probe needs a CUDA GPU")
        return
    info = ddpgraph.init_distributed()
    runs: dict[str, Callable[..., tuple[float, str]]] = {"DDP(...)": plain}
    for name, fn in (("accelerate", accelerate), ("lightning", lightning)):
        try:
            __import__("accelerate" if name == "accelerate" else "lightning")
            runs[name] = fn
        except ImportError:
            pass
    rows = []
    for model_name, model in _models().items():
        for run_name, run in runs.items():
            eager, _ = run(info, model, False)
            graphed, note = run(info, model, True)
            rows.append((model_name, run_name, eager, graphed, note))
    if info.is_main:
        print(
            f"world size {info.world_size}, torch {torch.__version__}, batch {BATCH}, "
            f"bf16, ms/step over {TIMED} steps"
        )
        print(f"{'model':<9}{'built by':<12}{'eager':>8}{'captured':>10}{'speedup':>9}  note")
        for model_name, run_name, eager, graphed, note in rows:
            speed = f"{eager / graphed:.2f}x" if not note else "-"
            print(f"{model_name:<9}{run_name:<12}{eager:>8.2f}{graphed:>10.2f}{speed:>9}  {note}")
        print(
            "median speedup:",
            f"{statistics.median(e / g for _, _, e, g, n in rows if not n):.2f}x"
            if any(not r[4] for r in rows)
            else "-",
        )
    shutdown()


if __name__ == "__main__":
    main()
