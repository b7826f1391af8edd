"""Random numbers inside a captured step: fresh on every replay, reproducible from the seed.

PyTorch registers the default CUDA generator of the capturing device with every CUDA
graph: a replay draws from the generator's offset at launch and advances it by the
graph's total, the same offsets the eager kernels would have used, so dropout masks
change from replay to replay and follow `torch.manual_seed`. A generator the step creates
itself (`torch.Generator(device="cuda")`) must be registered with the graph before
recording (`CUDAGraph.register_generator_state`); otherwise recording fails with
"Attempt to increase offset for a CUDA generator not in capture mode". From PyTorch 2.14
every generator is registered on first use and the call is a deprecated no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..errors import usage_error
from ..findings import Code, Finding


def _version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


# Pre-releases of 2.14 already register lazily, hence the (major, minor) comparison.
REGISTERS_LAZILY = _version() >= (2, 14)


def generators_refusal(
    generators: Sequence[torch.Generator], device: torch.device, cuda_graphs: bool
) -> Finding | None:
    """Why `generators` cannot follow replays of a step on `device` (the step then runs
    eagerly), or None. Raises `DdpGraphUsageError` for arguments that are wrong anywhere."""
    subject = "`capture_step(generators=...)`"
    for g in generators:
        if not isinstance(g, torch.Generator):
            raise usage_error(
                subject,
                f"expected torch.Generator objects, got {type(g).__name__}",
                "pass the generators the step draws from: `generators=[g]`",
            )
    if not (generators and cuda_graphs):
        return None
    if not (REGISTERS_LAZILY or hasattr(torch.cuda.CUDAGraph, "register_generator_state")):
        return Finding(
            Code.TORCH_TOO_OLD,
            f"PyTorch {torch.__version__} cannot register a generator with a CUDA graph "
            "(no `CUDAGraph.register_generator_state`)",
            "upgrade PyTorch, or draw from the default generator (`torch.manual_seed`), "
            "which every graph follows",
            subject=subject,
        )
    for g in generators:
        if g.device.type != "cuda" or g.device.index not in (None, device.index):
            raise usage_error(
                subject,
                f"expected generators on {device}, got one on {g.device}, whose numbers a "
                "graph would draw once while recording and then replay unchanged",
                f"create it with `torch.Generator(device={str(device)!r})`",
            )
    return None


def register_generators(graph: torch.cuda.CUDAGraph, generators: Sequence[torch.Generator]) -> None:
    """Register `generators` with `graph`; call before `capture_begin`, on the graph's device."""
    if REGISTERS_LAZILY:
        return
    for g in generators:
        graph.register_generator_state(g)


def keep_states(generators: Sequence[torch.Generator]) -> Callable[[], None]:
    """A function that puts `generators` back in their current state."""
    states = [g.get_state() for g in generators]

    def restore() -> None:
        for g, state in zip(generators, states, strict=True):
            g.set_state(state)

    return restore


def release_after_failed_capture(
    device: torch.device, generators: Sequence[torch.Generator]
) -> Callable[[], None]:
    """A function that takes the generators a capture on `device` draws from (the default
    one and `generators`) out of capture mode: call it when the capture fails.

    A capture whose end raises (an invalidated recording) leaves its generators in
    capture mode, and every later eager draw from them (dropout, `torch.randn`) fails
    with "Offset increment outside graph capture encountered unexpectedly". Their state
    from before the capture, with its seed and offset, is where eager training stands.
    """
    every = [torch.cuda.default_generators[device.index or 0], *generators]
    if not all(hasattr(g, "clone_state") and hasattr(g, "graphsafe_set_state") for g in every):
        return lambda: None
    saved = [(g, g.clone_state()) for g in every]

    def release() -> None:
        for g, state in saved:
            g.graphsafe_set_state(state)

    return release
