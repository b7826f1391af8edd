"""What in a `transformers.Trainer` setup one captured update cannot replay.

`CUDAGraphTrainer` captures one optimizer update of Trainer's loop: `training_step`
(forward, backward with DDP's all-reduce), gradient clipping and the optimizer step. The
setups below make that update something else than Trainer's own, or put work between
its parts that a replay cannot run; each is refused with a code, on every rank together,
and Trainer trains eagerly as without ddpgraph.
"""

from __future__ import annotations

from typing import Any

from accelerate.utils import DistributedType
from torch import nn
from torch.optim import Optimizer
from transformers import Trainer, TrainerCallback

from ..findings import Code, Finding
from ..strategies.dynamo import GRAPH_MODES, is_compiled_module, makes_graphs, unwrap_compiled

__all__ = ["SUBJECT", "trainer_refusal"]

SUBJECT = "`ddpgraph.integrations.transformers.CUDAGraphTrainer`"
# Accelerate's kinds of training a DDP step (or a single device) covers.
_DDP_KINDS = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
# The methods of Trainer's loop the captured update answers (transformers 5.x; earlier
# loops clipped inline, where nothing can answer them).
LOOP_METHODS = ("_clip_grad_norm", "_get_grad_norm", "training_step")
# Callback hooks Trainer calls between the gradients and the optimizer step, or right
# after the step while the gradients still exist: inside a replayed update neither runs
# where Trainer runs it.
_STEP_HOOKS = ("on_pre_optimizer_step", "on_optimizer_step")


def _unsupported(happened: str, fix: str) -> Finding:
    return Finding(Code.UNSUPPORTED_SETUP, happened, fix, subject=SUBJECT)


def trainer_refusal(trainer: Trainer, model: nn.Module) -> Finding | None:
    """Why `trainer`'s update of `model` (what Trainer passes `training_step`) cannot be
    captured, or None. The same on every rank for the same script and arguments."""
    args = trainer.args
    missing = [name for name in LOOP_METHODS if not callable(getattr(Trainer, name, None))]
    if missing:
        return _unsupported(
            f"this transformers' Trainer has no {', '.join(f'`{n}`' for n in missing)}, "
            "through which the captured update gives its loop the gradient norm",
            "install transformers 5 or later (`pip install -U transformers`), "
            "or train without ddpgraph",
        )
    if args.gradient_accumulation_steps > 1:
        return _unsupported(
            f"`TrainingArguments(gradient_accumulation_steps={args.gradient_accumulation_steps})` "
            "calls `training_step` once per micro-batch, under `no_sync` for all but the last, "
            "and steps the optimizer after the last: the calls differ, "
            "and no one of them is the whole update",
            "use `gradient_accumulation_steps=1` with `per_device_train_batch_size` "
            "that many times larger, or train without ddpgraph",
        )
    if args.fp16 or getattr(trainer.optimizer, "scaler", None) is not None:
        return Finding(
            Code.GRAD_SCALER_IN_CAPTURE,
            "`TrainingArguments(fp16=True)` scales the loss with a GradScaler, which reads its "
            "found-inf flag on the host in `optimizer.step()`",
            "use `bf16=True`, which needs no loss scaling",
            subject=SUBJECT,
        )
    return _parallelism_refusal(trainer, model) or _loop_refusal(trainer, model)


def _parallelism_refusal(trainer: Trainer, model: nn.Module) -> Finding | None:
    kind = trainer.accelerator.distributed_type
    if kind not in _DDP_KINDS:
        return _unsupported(
            f"Trainer trains with {getattr(kind, 'value', kind)}, not DistributedDataParallel",
            "train with DDP (torchrun without a DeepSpeed or FSDP configuration), "
            "or without ddpgraph",
        )
    if getattr(trainer, "is_distributed_loading_by_transformers", False) or (
        getattr(trainer.accelerator, "parallelism_config", None) is not None
    ):
        return _unsupported(
            "the model is sharded (tensor, context or sequence parallelism), which DDP does not do",
            "train the model replicated with DDP, or without ddpgraph",
        )
    target = unwrap_compiled(model)
    if trainer.args.n_gpu > 1 or isinstance(target, nn.DataParallel):
        return _unsupported(
            "Trainer wraps the model in `torch.nn.DataParallel` "
            f"({trainer.args.n_gpu} GPUs in one process)",
            "launch one process per GPU with `torchrun --nproc_per_node=N`, which trains with DDP",
        )
    if is_compiled_module(model) and (
        makes_graphs(model) or trainer.args.torch_compile_mode in GRAPH_MODES
    ):
        return _unsupported(
            f"`torch_compile_mode={trainer.args.torch_compile_mode!r}` makes CUDA graphs of "
            "its own, which cannot be recorded inside the update's graph",
            "leave `torch_compile_mode` out (inductor's default mode fuses without graphs) and "
            "let ddpgraph capture the whole update",
        )
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    if not isinstance(inner, Optimizer):
        return _unsupported(
            f"the optimizer is a {type(inner).__name__}, not a torch.optim.Optimizer",
            'use one of Trainer\'s torch optimizers (`optim="adamw_torch_fused"`, the default)',
        )
    return None


def _loop_refusal(trainer: Trainer, model: nn.Module) -> Finding | None:
    args = trainer.args
    if args.torch_empty_cache_steps is not None:
        return _unsupported(
            f"`torch_empty_cache_steps={args.torch_empty_cache_steps}` empties "
            "the memory cache inside `training_step` on steps counted in Python, "
            "which a replay neither counts nor runs",
            "leave `torch_empty_cache_steps` out: a captured update allocates "
            "nothing after capture",
        )
    if args.auto_find_batch_size:
        return _unsupported(
            "`auto_find_batch_size=True` restarts training with a new model wrapper and optimizer "
            "after an out-of-memory error, which may happen on some ranks only",
            "set `per_device_train_batch_size` to a size that fits",
        )
    for callback in trainer.callback_handler.callbacks:
        hook = _step_hook(callback)
        if hook is not None:
            return _unsupported(
                f"the callback {type(callback).__name__} implements `{hook}`, "
                "which Trainer runs between the gradients and the optimizer's update; "
                "in a replayed update the gradients are gone when Trainer calls it",
                "move that work to `on_step_end`, or remove the callback "
                f"(`trainer.remove_callback({type(callback).__name__})`)",
            )
    return None


def _step_hook(callback: Any) -> str | None:
    for name in _STEP_HOOKS:
        if getattr(type(callback), name, None) is not getattr(TrainerCallback, name):
            return name
    return None
