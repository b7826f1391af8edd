"""Which graph backend and stream a captured step uses, or why it cannot capture.

One small function, so that a new way to accept a model (a DDP built elsewhere, adopted
onto the capture stream) changes this decision and nothing else.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..ddp import build as ddp_tools
from ..ddp.adopt import adoption_method, adoption_refusal
from ..ddp.streams import can_run_graphs
from ..findings import Code, Finding
from .graph import CudaGraphBackend, GraphBackend


def choose_backend(
    model: nn.Module,
    device: torch.device,
    backend: GraphBackend | None,
    stream: torch.cuda.Stream | None,
) -> tuple[GraphBackend | None, torch.cuda.Stream | None, Finding | None]:
    """The backend and stream a step captures with, or why it cannot capture at all."""
    if not can_run_graphs(device):
        if backend is not None:
            return backend, None, None  # a stand-in backend on CPU
        why = (
            "CUDA is not available (torch.cuda.is_available() is False)"
            if not torch.cuda.is_available()
            else f"the model's parameters are on {device}"
        )
        return (
            None,
            None,
            Finding(Code.NO_CUDA, f"{why}; the step runs eagerly", subject="`capture_step`"),
        )
    built_on = ddp_tools.built_on_stream(model)
    if stream is not None:
        if isinstance(model, DDP):
            ddp_tools.mark_built_on(model, stream)
    else:
        from ..ddp.streams import capture_stream

        if isinstance(model, DDP) and built_on is None:
            # A DDP built elsewhere (usually on the default stream) is adopted onto the
            # capture stream once every rank has agreed (`needs_adoption`); what would
            # stop that is found here, before anything changes.
            refusal = adoption_refusal(model, adoption_method())
            if refusal is not None:
                return backend, None, refusal
        stream = built_on or capture_stream(device)
    return backend or CudaGraphBackend(), stream, None


def needs_adoption(model: nn.Module, stream: torch.cuda.Stream | None) -> bool:
    """Whether `model` is a DDP built on another stream than `stream`, the capture stream
    `choose_backend` picked: it must be adopted (`adopt.apply_adoption`) before warm-up."""
    return (
        stream is not None and isinstance(model, DDP) and ddp_tools.built_on_stream(model) is None
    )
