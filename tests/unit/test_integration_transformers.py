"""`ddpgraph.integrations.transformers.CUDAGraphTrainer` in one process: what it refuses and why,
its arguments checked before Trainer builds anything, and a whole `train()` on a
model without DDP (what Trainer trains at world size 1) with the recording backend,
equal to plain Trainer with the same graph-safe optimizer. The DDP runs over gloo are
in tests/dist/test_trainer_gloo.py."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
from accelerate.state import AcceleratorState, GradientState
from transformers import Trainer, TrainerCallback, TrainingArguments

import ddpgraph
from ddpgraph import Code
from ddpgraph.integrations import transformers_setup
from ddpgraph.integrations.transformers import CUDAGraphTrainer, GraphSafeReference, trainer_refusal

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
STEPS = 10


@pytest.fixture(autouse=True)
def _fresh_accelerate() -> Iterator[None]:
    # Accelerate keeps its state in process-wide singletons.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _scenario() -> Any:
    import importlib
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "scenarios"))
    try:
        return importlib.import_module("trainer_train")
    finally:
        sys.path.pop(0)


def _args(tmp_path: Path, **kw: Any) -> TrainingArguments:
    base: dict[str, Any] = {
        "output_dir": str(tmp_path),
        "use_cpu": True,
        "per_device_train_batch_size": 4,
        "max_steps": STEPS,
        "learning_rate": 3e-3,
        "lr_scheduler_type": "cosine",
        "warmup_steps": 2,
        "max_grad_norm": 1.0,
        "logging_steps": 2,
        "report_to": "none",
        "save_strategy": "no",
        "seed": 0,
        "disable_tqdm": True,
    }
    base.update(kw)
    return TrainingArguments(**base)


def _ready(trainer: Trainer) -> Trainer:
    """Trainer as `training_step` first sees it: its optimizer made and prepared."""
    trainer.create_optimizer()
    trainer.optimizer = trainer.accelerator.prepare(trainer.optimizer)
    return trainer


def _refusal(tmp_path: Path, *, callbacks: list[TrainerCallback] | None = None, **kw: Any) -> Any:
    s = _scenario()
    trainer = _ready(
        Trainer(
            model=s.gpt2(),
            args=_args(tmp_path, **kw),
            callbacks=callbacks,
            train_dataset=s.Sequences(16),
        )
    )
    return trainer, trainer_refusal(trainer, trainer.model)


def test_trainers_defaults_are_capturable(tmp_path: Path) -> None:
    assert _refusal(tmp_path)[1] is None


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (
            {"gradient_accumulation_steps": 4},
            Code.UNSUPPORTED_SETUP,
            "gradient_accumulation_steps=4",
        ),
        ({"torch_empty_cache_steps": 5}, Code.UNSUPPORTED_SETUP, "torch_empty_cache_steps=5"),
        ({"auto_find_batch_size": True}, Code.UNSUPPORTED_SETUP, "auto_find_batch_size=True"),
    ],
)
def test_what_one_update_cannot_replay_is_refused_with_its_code(
    tmp_path: Path, args: dict[str, Any], code: Code, words: str
) -> None:
    _, refusal = _refusal(tmp_path, **args)
    assert refusal is not None and refusal.code is code and words in refusal.happened, refusal
    assert refusal.fix and refusal.subject == transformers_setup.SUBJECT


def test_fp16_loss_scaling_is_refused_with_the_bf16_fix(tmp_path: Path) -> None:
    trainer, _ = _refusal(tmp_path)
    trainer.args.fp16 = (
        True  # Trainer refuses fp16 on CPU at construction; the check reads the flag
    )
    refusal = trainer_refusal(trainer, trainer.model)
    assert (
        refusal is not None
        and refusal.code is Code.GRAD_SCALER_IN_CAPTURE
        and "bf16=True" in refusal.fix
    )


def test_a_compile_mode_with_graphs_of_its_own_is_refused(tmp_path: Path) -> None:
    trainer, _ = _refusal(tmp_path)
    trainer.args.torch_compile_mode = "reduce-overhead"
    compiled = torch.compile(trainer.model, backend="eager")
    refusal = trainer_refusal(trainer, compiled)
    assert refusal is not None and "reduce-overhead" in refusal.happened


def test_data_parallel_in_one_process_is_refused(tmp_path: Path) -> None:
    trainer, _ = _refusal(tmp_path)
    refusal = trainer_refusal(trainer, torch.nn.DataParallel(trainer.model))
    assert refusal is not None and "DataParallel" in refusal.happened and "torchrun" in refusal.fix


class _PeekAtGrads(TrainerCallback):
    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        pass


def test_a_callback_between_the_gradients_and_the_step_is_refused_by_name(tmp_path: Path) -> None:
    _, refusal = _refusal(tmp_path, callbacks=[_PeekAtGrads()])
    assert refusal is not None and "_PeekAtGrads implements `on_optimizer_step`" in refusal.happened
    assert "on_step_end" in refusal.fix


def test_a_trainer_without_the_loop_methods_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer, _ = _refusal(tmp_path)
    monkeypatch.delattr(Trainer, "_get_grad_norm")
    refusal = trainer_refusal(trainer, trainer.model)
    assert refusal is not None and "`_get_grad_norm`" in refusal.happened


def test_wrong_capture_arguments_fail_before_trainer_builds_anything(tmp_path: Path) -> None:
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="on_failure"):
        CUDAGraphTrainer(model=_scenario().gpt2(), args=_args(tmp_path), on_failure="retry")  # type: ignore[arg-type]
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="warmup_steps"):
        CUDAGraphTrainer(model=_scenario().gpt2(), args=_args(tmp_path), capture_warmup_steps=0)


def _train(tmp_path: Path, graphs: bool, **kw: Any) -> tuple[Trainer, Any]:
    s = _scenario()
    common: dict[str, Any] = {
        "model": s.gpt2(),
        "args": _args(tmp_path, **kw),
        "train_dataset": s.Sequences(4 * STEPS),
    }
    trainer: Trainer
    if graphs:
        trainer = CUDAGraphTrainer(backend=ddpgraph.RecordingBackend(), **common)
    else:
        trainer = Trainer(callbacks=[GraphSafeReference()], **common)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return trainer, [p.detach().clone() for p in trainer.model.parameters()]


def test_a_model_without_ddp_is_captured_and_trains_like_trainer(tmp_path: Path) -> None:
    plain, plain_params = _train(tmp_path / "plain", graphs=False)
    graphed, graphed_params = _train(tmp_path / "graphed", graphs=True)
    graphs = graphed.graphs  # type: ignore[attr-defined]
    assert graphs.state == "captured" and graphs.reason is None
    assert graphs.stats["warmup_steps"] == 3 and graphs.stats["replays"] == STEPS - 3
    logged = [[e for e in t.state.log_history if "loss" in e] for t in (plain, graphed)]
    assert len(logged[0]) == STEPS // 2 and logged[0] == logged[1]  # loss, grad_norm, learning_rate
    assert all(torch.equal(a, b) for a, b in zip(plain_params, graphed_params, strict=True))
    assert "step" not in vars(graphed.optimizer) or hasattr(
        graphed.optimizer.step, "_wrapped_by_lr_sched"
    )


def test_without_a_gpu_or_backend_trainer_trains_eagerly_and_says_why(tmp_path: Path) -> None:
    s = _scenario()
    trainer = CUDAGraphTrainer(
        model=s.gpt2(), args=_args(tmp_path, max_steps=3), train_dataset=s.Sequences(12)
    )
    trainer.train()
    assert trainer.graphs.state == "eager" and trainer.graphs.reason is not None
    assert trainer.graphs.reason.code is Code.NO_CUDA
