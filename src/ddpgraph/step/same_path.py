"""The recording runs the step's Python code the way its eager steps run it.

A graph replays the kernels its recording launched. If a library takes another branch
because a stream is capturing, the graph computes something else than the eager steps
it stands for. transformers does: up to at least 5.17 its `is_tracing()` is true while a
CUDA stream captures, and its causal-mask builder then passes an explicit mask to SDPA
where eager steps pass `is_causal=True`, so the graph records the attention another way.
Measured on one H200 (torch 2.11, a Llama of hidden size 512, 8 layers, sdpa, bf16): the
forward outputs are equal, cuDNN attention's backward rounds differently, 2.1e-4 relative
in parameters after 11 eager steps and 3 replays (`scripts/probes/transformers_capture_branch.py`).

The last warm-up step ran the eager branch under CUDA's sync debug mode and found no host
synchronisation in it (or the step was not captured at all), so the recording can take
that branch too: while recording, such libraries are told that nothing is capturing.
PyTorch itself is not: its own checks (optimizers, RNG, allocator) see the capture.
Where the eager branch did synchronise (the Llama's mask builder reads the position ids
to rule out packed sequences), the recording must leave the library its capture branch;
`report_capture_branch` says so once the capture succeeded; `parity=` measures the
difference, and its finding names that synchronisation as the likely cause.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ..findings import Finding

log = logging.getLogger("ddpgraph")

# (module, function) pairs a library consults to ask "is a CUDA stream capturing?".
CAPTURE_CHECKS: tuple[tuple[str, str], ...] = (
    ("transformers.utils.import_utils", "is_cuda_stream_capturing"),
)


def _not_capturing() -> bool:
    return False


@contextmanager
def eager_code_paths() -> Iterator[None]:
    """Within the block, the libraries of `CAPTURE_CHECKS` that are imported see no capture."""
    kept = []
    for module_name, name in CAPTURE_CHECKS:
        module = sys.modules.get(module_name)
        if module is not None and callable(getattr(module, name, None)):
            kept.append((module, name, getattr(module, name)))
            setattr(module, name, _not_capturing)
    try:
        yield
    finally:
        for module, name, original in kept:
            setattr(module, name, original)


def synchronised_at(sync: Finding) -> str:
    """What a library's host synchronisation in the probe step was: the chain from the
    user's line to the library's line that waited (`probe.host_sync_finding`'s words)."""
    return sync.happened or (str(sync.location) if sync.location else sync.subject)


def report_capture_branch(library_syncs: Sequence[Finding], rank: int) -> None:
    """After a capture that left a library its capture-time branch (it synchronised with
    the host in the probe step, and skips that while recording): say so, on rank 0, since
    the graph may then compute that part of the step another way than the eager steps."""
    if not library_syncs or rank != 0:
        return
    log.warning(
        "captured; in the eager steps %s. The library skips that host synchronisation while "
        "a graph is recorded, so the graph may compute that part of the step another way and "
        "round differently from eager steps (measured on one H200: a transformers Llama called "
        "without an attention mask, 2.1e-4 relative in parameters after 14 steps; a GPT-2, "
        "equal bit for bit). To measure it on this model at capture: "
        "capture_step(..., parity=ddpgraph.ParityCheck(rtol=...))",
        synchronised_at(library_syncs[0]),
    )
