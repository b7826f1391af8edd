"""Building DDP so that it can be captured, and reading what the reducer has done.

`prepare_ddp` is the supported way to build the model: it constructs DDP on ddpgraph's
capture stream and counts the reducer's iterations, which the warm-up policy needs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..errors import usage_error
from ..frozen.call_lines import CallLine, call_line
from .streams import capture_stream

_STREAM_ATTR = "_ddpgraph_stream"
_COUNTER_ATTR = "_ddpgraph_counter"


class ForwardCounter:
    """Counts DDP forwards that the reducer counts (grad enabled and gradient sync on),
    and, in `unsynced`, those with grad enabled under `no_sync()`.

    `exact` is False when the counter was attached to a model that had already run,
    and the count before that is an estimate.
    """

    def __init__(self, start: int = 0, exact: bool = True) -> None:
        self.count = start
        self.exact = exact
        self.unsynced = 0
        # The user's line of the latest forward under `no_sync()`, for the finding on it.
        self.unsynced_line: CallLine | None = None

    def __call__(self, module: nn.Module, args: Any) -> None:
        # Mirrors the condition under which DDP._pre_forward calls prepare_for_forward.
        if getattr(module, "_use_python_reducer", False) or getattr(
            module, "_delay_all_reduce_all_params", False
        ):
            return
        if not torch.is_grad_enabled():
            return
        if getattr(module, "require_backward_grad_sync", True):
            self.count += 1
        else:
            self.unsynced += 1
            self.unsynced_line = call_line(sys._getframe(1))


def prepare_ddp(model: nn.Module, **ddp_kwargs: Any) -> DDP:
    """Wrap `model` in `DistributedDataParallel` so that its training step can be captured.

    Takes DDP's own keyword arguments (`find_unused_parameters`, `gradient_as_bucket_view`,
    `static_graph`, `bucket_cap_mb`, ...). `device_ids` is inferred when left out: the
    model's GPU for a model on one GPU (one GPU per process), none on CPU or for a model
    spread over several GPUs, as DDP wants them. On CUDA, DDP is
    constructed on ddpgraph's capture stream for the model's device, the stream on which
    `capture_step` later warms up and captures; DDP's gradient accumulators then live on
    the capture stream, which is what lets backward be recorded. On CPU this is plain DDP.

    Requires an initialised default process group (`torch.distributed.init_process_group`
    or `ddpgraph.init_distributed()`).
    """
    if isinstance(model, DDP):
        raise usage_error(
            "`prepare_ddp(model)`",
            "expected the bare module, got a model that is already DistributedDataParallel",
            "pass the module itself: `ddpgraph.prepare_ddp(module)`",
        )
    if not isinstance(model, nn.Module):
        raise usage_error(
            "`prepare_ddp(model)`",
            f"expected a torch.nn.Module, got {type(model).__name__}",
            "pass the model to train",
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise usage_error(
            "`prepare_ddp`",
            "the default process group is not initialised",
            "call `ddpgraph.init_distributed()` (or `torch.distributed.init_process_group`) "
            "first, and launch with `torchrun`",
        )
    device = model_device(model)
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    ddp_kwargs = {
        **ddp_kwargs,
        "device_ids": infer_device_ids(devices, ddp_kwargs.get("device_ids")),
    }
    if device.type == "cuda":
        stream = capture_stream(device)
        caller = torch.cuda.current_stream(device)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            ddp = DDP(model, **ddp_kwargs)
        caller.wait_stream(stream)
        setattr(ddp, _STREAM_ATTR, stream)
    else:
        ddp = DDP(model, **ddp_kwargs)
    counter = ForwardCounter()
    ddp.register_forward_pre_hook(counter)
    setattr(ddp, _COUNTER_ATTR, counter)
    return ddp


def infer_device_ids(devices: set[torch.device], given: Any) -> list[int] | None:
    """DDP's `device_ids` for a model whose tensors are on `devices`: `given` when it is
    usable, inferred when left out (DDP wants the GPU of a one-GPU model, and None for a
    CPU model or one spread over several GPUs)."""
    single_gpu = len(devices) == 1 and next(iter(devices)).type == "cuda"
    if given is None or (isinstance(given, (list, tuple)) and not given):
        return [next(iter(devices)).index or 0] if single_gpu else None
    ids = list(given) if isinstance(given, (list, tuple)) else None
    if ids is not None and single_gpu and all(isinstance(i, (int, torch.device)) for i in ids):
        return ids  # type: ignore[return-value]
    where = ", ".join(sorted(str(d) for d in devices)) or "no parameters"
    raise usage_error(
        "`prepare_ddp(device_ids=...)`",
        f"expected the model's GPU as a one-element list, got {given!r} for a model on {where}",
        "leave `device_ids` out: prepare_ddp infers it from the model's device (the GPU of a "
        "model on one GPU, none on CPU)",
    )


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); CPU for a model with neither."""
    for param in model.parameters():
        return param.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("cpu")


def inner_module(model: nn.Module) -> nn.Module:
    """The module a DDP model wraps (`.module`); any other model itself."""
    return model.module if isinstance(model, DDP) else model


def process_group_of(model: nn.Module) -> Any:
    """The process group a DDP model reduces over; None (no peers) for any other model."""
    return model.process_group if isinstance(model, DDP) else None


def built_on_stream(model: nn.Module) -> torch.cuda.Stream | None:
    """The stream `prepare_ddp` built this DDP model on, or None."""
    stream = getattr(model, _STREAM_ATTR, None)
    return stream if isinstance(stream, torch.cuda.Stream) else None


def mark_built_on(model: DDP, stream: torch.cuda.Stream) -> None:
    """Record that the user built `model` on `stream` themselves."""
    setattr(model, _STREAM_ATTR, stream)


def forward_counter(model: nn.Module) -> ForwardCounter | None:
    """The reducer-iteration counter of a DDP model, attaching one if it has none.

    A model `prepare_ddp` did not build may already have run; its count is then read
    from DDP's logging data, which records the last sampled iteration: a lower bound.
    """
    if not isinstance(model, DDP):
        return None
    counter = getattr(model, _COUNTER_ATTR, None)
    if isinstance(counter, ForwardCounter):
        return counter
    start = 0
    try:
        start = int(model._get_ddp_logging_data().get("iteration", 0))
    except Exception:  # prototype API: absence only costs precision
        start = 0
    counter = ForwardCounter(start, exact=False)
    model.register_forward_pre_hook(counter)
    setattr(model, _COUNTER_ATTR, counter)
    return counter


def reducer_finalized(model: nn.Module) -> bool:
    """False when the reducer is stuck mid-backward (a failed capture can leave it so)."""
    reducer = getattr(model, "reducer", None)
    check = getattr(reducer, "_check_reducer_finalized", None)
    if check is None:
        return True
    try:
        check()
    except RuntimeError:
        return False
    return True


def reset_reducer(model: nn.Module) -> None:
    """Let the next forward run after an interrupted backward.

    This also makes the reducer rebuild its buckets after the next backward, with a
    collective, so every rank must call it together.
    """
    reducer = getattr(model, "reducer", None)
    reset = getattr(reducer, "_reset_state", None)
    if reset is not None:
        reset()
        if isinstance(model, DDP):
            model._has_rebuilt_buckets = False  # DDP's own flag; mirrors the reducer


def will_sync_buffers(model: nn.Module) -> bool:
    """Whether DDP's next forward broadcasts the module buffers from rank 0.

    DDP skips that broadcast in the first forward after one that will not sync gradients
    (an eval forward under `no_grad`, a `no_sync` micro-batch): a graph recorded with the
    broadcast must not replay in its place.
    """
    return isinstance(model, DDP) and bool(model.will_sync_module_buffers())


def buffer_sync_skipped(model: nn.Module) -> bool:
    """True when DDP's next forward will skip a buffer broadcast it normally does, because
    the previous forward was a `no_grad` one. Capture waits one step then: a graph recorded
    without the broadcast would never broadcast again."""
    if not isinstance(model, DDP) or will_sync_buffers(model):
        return False
    syncs = getattr(model, "forward_sync_buffers", getattr(model, "broadcast_buffers", False))
    return bool(syncs) and len(getattr(model, "modules_buffers", [])) > 0


def restart_counter(model: DDP) -> None:
    """Count the reducer's iterations from zero again: its reducer was just rebuilt."""
    counter = getattr(model, _COUNTER_ATTR, None)
    if isinstance(counter, ForwardCounter):
        counter.count, counter.exact = 0, True
        return
    counter = ForwardCounter()
    model.register_forward_pre_hook(counter)
    setattr(model, _COUNTER_ATTR, counter)


def keep_forward_sync(model: nn.Module) -> Callable[[], None]:
    """What puts back DDP's `require_forward_param_sync` as it is now. DDP's forward
    clears it under no_grad, and it decides whether the next forward broadcasts buffers:
    a failed recording ran no broadcast, so the eager call that replaces it must still
    make one, as eager training would."""
    was = getattr(model, "require_forward_param_sync", None)

    def restore() -> None:
        if was is not None:
            model.require_forward_param_sync = was  # type: ignore[assignment]

    return restore
