"""`transformers.Trainer` against `ddpgraph.integrations.transformers.CUDAGraphTrainer`,
from the same state and data: a GPT-2 from a transformers config (no download), Trainer's own
DataLoader, AdamW (fused, its default), linear or cosine schedule with warm-up,
clipping, logging every `logging_steps`, evaluation and checkpoints. On gloo CPU
processes (`use_cpu=True`) with the recording backend (tests/dist/test_trainer_gloo.py),
or one process per GPU with CUDA graphs (tests/gpu/test_trainer_gpu.py).

The reference Trainer runs its optimizer in ddpgraph's graph-safe mode (`GraphSafeReference`), as
the captured Trainer's eager steps do, so both do the same arithmetic and must agree bit
for bit. Trainer joins the process group the harness opened (torchrun's variables).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import harness
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from ddpgraph.ddp.distributed import DistInfo
from ddpgraph.integrations.transformers import CUDAGraphTrainer, GraphSafeReference

VOCAB, SEQ, BATCH, STEPS = 64, 16, 4, 24


class Sequences(Dataset[dict[str, torch.Tensor]]):
    """A learnable next-token task: each token is the previous one plus a fixed step."""

    def __init__(self, n: int, seed: int = 3) -> None:
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=gen)
        step = torch.randint(1, 7, (n, 1), generator=gen)
        self.ids = (start + step * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        # Every third sequence padded at its end, as a collator pads shorter texts.
        keep = SEQ - 4 * (i % 3 == 0)
        mask = (torch.arange(SEQ) < keep).long()
        return {
            "input_ids": self.ids[i],
            "attention_mask": mask,
            "labels": self.ids[i].masked_fill(mask == 0, -100),
        }


def gpt2(**config: Any) -> GPT2LMHeadModel:
    """transformers' own attention: with SDPA, transformers reads the mask on the host to
    choose SDPA's causal shortcut, except while a CUDA stream captures, which the CPU
    recording cannot tell it (tests/scenarios/families.py shows both)."""
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        attn_implementation=config.pop("attn_implementation", "eager"),
        **config,
    )
    return GPT2LMHeadModel(cfg)


class Record(TrainerCallback):
    """Per step: the learning rate the scheduler set, whether every module is in train
    mode (after an evaluation too), when the step ended."""

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.train_mode: list[bool] = []
        self.times: list[float] = []

    def on_step_end(
        self,
        args: Any,
        state: Any,
        control: Any,
        optimizer: Any = None,
        model: Any = None,
        **kwargs: Any,
    ) -> None:
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))
        self.train_mode.append(all(m.training for m in model.modules()))
        self.times.append(time.perf_counter())


def _root(name: str) -> str:
    # Under the launch's folder (the same on every rank), which the test's tmp_path owns.
    return str(Path(harness.out_dir()) / f"trainer_{name}")


class CountGrads(TrainerCallback):
    """Counts the parameters that have a gradient before each optimizer step."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_pre_optimizer_step(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        self.counts.append(sum(p.grad is not None for p in model.parameters()))


def train(
    info: DistInfo,
    *,
    graphs: bool,
    steps: int = STEPS,
    model_kw: dict[str, Any] | None = None,
    output: str | None = None,
    resume: str | None = None,
    graph_safe: bool = True,
    extra_callback_on: int | None = None,
    resume_again: str | None = None,
    **args_kw: Any,
) -> dict[str, Any]:
    on_cpu = info.device.type == "cpu"
    kw: dict[str, Any] = {
        "output_dir": output or _root("scratch"),
        "use_cpu": on_cpu,
        "per_device_train_batch_size": BATCH,
        "max_steps": steps,
        "learning_rate": 3e-3,
        "lr_scheduler_type": "cosine",
        "warmup_steps": 3,
        "max_grad_norm": 1.0,
        "logging_steps": 4,
        "report_to": "none",
        "save_strategy": "no",
        "seed": 0,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    kw.update(args_kw)
    args = TrainingArguments(**kw)
    record = Record()
    callbacks: list[TrainerCallback] = [record]
    if extra_callback_on == info.rank:
        callbacks.append(CountGrads())
    common: dict[str, Any] = {
        # On a GPU, SDPA (transformers skips its host read of the mask while a stream
        # captures); on CPU, eager attention (the recording cannot tell it).
        "model": gpt2(**{"attn_implementation": "eager" if on_cpu else "sdpa", **(model_kw or {})}),
        "args": args,
        "callbacks": callbacks,
        "train_dataset": Sequences(BATCH * steps * info.world_size),
        "eval_dataset": Sequences(2 * BATCH * info.world_size, seed=4),
    }
    if graphs:
        backend = harness.backend() if on_cpu else None
        trainer: Trainer = CUDAGraphTrainer(backend=backend, **common)
    else:
        if graph_safe:
            callbacks.append(GraphSafeReference())
        trainer = Trainer(**common)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    if resume_again is not None:  # the same Trainer trains again from its own checkpoint
        trainer.train(resume_from_checkpoint=resume_again)
    seconds = time.perf_counter() - start
    logs = trainer.state.log_history
    out: dict[str, Any] = {
        "losses": [e["loss"] for e in logs if "loss" in e],
        "grad_norms": [e["grad_norm"] for e in logs if "grad_norm" in e],
        "logged_lrs": [e["learning_rate"] for e in logs if "learning_rate" in e and "loss" in e],
        "eval_losses": [e["eval_loss"] for e in logs if "eval_loss" in e],
        "train_loss": next((e["train_loss"] for e in logs if "train_loss" in e), None),
        "lrs": record.lrs,
        "train_mode": record.train_mode,
        "steps": trainer.state.global_step,
        "params": harness.params_of(trainer.model),
        "seconds": seconds,
        "ms_per_step": _ms_per_step(record.times),
    }
    if graphs:
        g = trainer.graphs  # type: ignore[attr-defined]
        out.update(
            state=g.state,
            code=g.reason.code.value if g.reason else None,
            reason=g.reason.format() if g.reason else None,
            stats=g.stats,
            eager_reason=g.eager_reason.format() if g.eager_reason else None,
            restored="step" not in vars(trainer.optimizer)
            or _is_schedulers(trainer.optimizer.step),
        )
    return out


def _is_schedulers(step: Any) -> bool:
    return bool(getattr(step, "_wrapped_by_lr_sched", False))


def _ms_per_step(times: list[float]) -> float | None:
    """Over the second half of the steps (warm-up and capture are in the first)."""
    half = times[len(times) // 2 :]
    return 1000 * (half[-1] - half[0]) / (len(half) - 1) if len(half) > 1 else None


def compare(info: DistInfo, *, refused: bool = False, **kw: Any) -> dict[str, Any]:
    graphed = train(info, graphs=True, **kw)
    plain = train(
        info, graphs=False, graph_safe=not refused, **kw
    )  # a refused run leaves the optimizer as written
    same = {
        k: plain[k] == graphed[k]
        for k in (
            "losses",
            "grad_norms",
            "logged_lrs",
            "lrs",
            "eval_losses",
            "train_loss",
            "train_mode",
        )
    }
    return {
        **{
            k: graphed[k]
            for k in (
                "state",
                "code",
                "reason",
                "stats",
                "eager_reason",
                "restored",
                "lrs",
                "losses",
                "steps",
                "eval_losses",
            )
        },
        "same": same,
        "param_rel_diff": harness.rel_diff(plain["params"], graphed["params"]),
        "seconds": {"plain": plain["seconds"], "graphed": graphed["seconds"]},
    }


def checkpoint_resume(info: DistInfo) -> dict[str, Any]:
    """Trained with `save_steps`, a new Trainer resumes from the middle checkpoint for the
    rest: the checkpoint saved from a live graph equals the eager one, and the resumed run
    captures again and trains as the resumed eager run does."""
    out: dict[str, Any] = {}
    for graphs in (False, True):
        root = _root(f"ckpt{int(graphs)}")
        shutil.rmtree(root, ignore_errors=True)
        # Saved 3 steps after the capture; resumed for 11 warm-up steps and 7 replays.
        saved = train(
            info, graphs=graphs, steps=32, output=root, save_strategy="steps", save_steps=14
        )
        middle = os.path.join(root, "checkpoint-14")
        state = torch.load(os.path.join(middle, "optimizer.pt"), weights_only=False)["state"]
        resumed = train(info, graphs=graphs, steps=32, output=root, resume=middle)
        out[str(graphs)] = {"saved": saved, "resumed": resumed, "opt_state": state}
    plain, graphed = out["False"], out["True"]
    ranks_saved = sorted(os.listdir(_root("ckpt1")))
    return {
        "saved_dirs": ranks_saved,
        "state": graphed["resumed"]["state"],
        "stats": graphed["resumed"]["stats"],
        "code": graphed["resumed"]["code"],
        "steps": graphed["resumed"]["steps"],
        "resumed_losses": graphed["resumed"]["losses"],
        "same_checkpoint": all(
            torch.equal(plain["opt_state"][k][n], graphed["opt_state"][k][n])
            for k in plain["opt_state"]
            for n in plain["opt_state"][k]
        ),
        "same_resumed_losses": plain["resumed"]["losses"] == graphed["resumed"]["losses"],
        "param_rel_diff": harness.rel_diff(
            plain["resumed"]["params"], graphed["resumed"]["params"]
        ),
        "uninterrupted_rel_diff": harness.rel_diff(
            plain["saved"]["params"], plain["resumed"]["params"]
        ),
    }


def resume_same_trainer(info: DistInfo) -> dict[str, Any]:
    """One Trainer trains with `save_steps`, then trains again from its middle checkpoint
    (`train(resume_from_checkpoint=...)` on the same object, its model and DDP reused):
    the second `train()` captures again and ends where plain Trainer's does."""
    out: dict[str, Any] = {}
    for graphs in (False, True):
        root = _root(f"again{int(graphs)}")
        shutil.rmtree(root, ignore_errors=True)
        out[str(graphs)] = train(
            info,
            graphs=graphs,
            steps=32,
            output=root,
            save_strategy="steps",
            save_steps=14,
            resume_again=os.path.join(root, "checkpoint-14"),
        )
    plain, graphed = out["False"], out["True"]
    return {
        **{k: graphed[k] for k in ("state", "code", "reason", "stats", "restored")},
        "same_losses": plain["losses"] == graphed["losses"],
        "param_rel_diff": harness.rel_diff(plain["params"], graphed["params"]),
    }


REGISTRY: dict[str, harness.Scenario] = {
    "cosine": lambda info: compare(info),
    "linear_bf16": lambda info: compare(info, lr_scheduler_type="linear", bf16=True),
    "evaluate": lambda info: compare(info, eval_strategy="steps", eval_steps=8),
    "no_clipping": lambda info: compare(info, max_grad_norm=0.0),
    # Dynamo's eager backend on CPU (no code generation: seconds, and aten operations the
    # recording sees); inductor, Trainer's default, on a GPU.
    "compiled": lambda info: compare(
        info,
        torch_compile=True,
        torch_compile_backend="eager" if info.device.type == "cpu" else "inductor",
    ),
    "one_rank_callback": lambda info: compare(
        info, refused=True, extra_callback_on=info.world_size - 1
    ),
    "dropout": lambda info: compare(info, model_kw={"resid_pdrop": 0.1, "embd_pdrop": 0.1}),
    "accumulate": lambda info: compare(
        info, refused=True, gradient_accumulation_steps=2, max_steps=12
    ),
    "checkpoint_resume": checkpoint_resume,
    "resume_same_trainer": resume_same_trainer,
}

if __name__ == "__main__":
    harness.run(REGISTRY)
