"""The rules for a capture that raised, and for an error that ended the script.

A failed capture is explained by this rank's own evidence first (a DDP model built on the
default stream, a DDP forward recorded before the reducer was ready), then by the shared
diagnosis of `ddpgraph.diagnose` (host syncs, the errors' text), which `capture_step`
uses as well.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..diagnose import capture_findings, error_location, first_line
from ..findings import Code, Finding
from ..probe import SyncEvent
from ..warmup import MIN_WARMUP_ITERATIONS, is_capturable_forward, steps_until_capturable
from .observed import DdpForward, Graph

# Texts of PyTorch's errors for a copy between tensors of different shapes.
_SHAPE_MISMATCH = ("must match the size", "match the broadcast shape", "size mismatch")


def capture_failure_findings(
    graph: Graph, errors: Sequence[BaseException], syncs: Sequence[SyncEvent]
) -> list[Finding]:
    """What made the capture of `graph` raise `errors`."""
    known: list[Finding] = []
    for ddp in {id(f.ddp): f.ddp for f in graph.forwards}.values():
        if ddp.built_on is not None and ddp.built_on.is_default:
            known.append(
                Finding(
                    Code.DDP_STREAM_MISMATCH,
                    "DistributedDataParallel was built on the default CUDA stream, so its "
                    "gradient accumulators belong to that stream; backward inside the "
                    "capture then makes the default stream wait on the capture stream, "
                    "which invalidates the capture",
                    "build DDP inside `with torch.cuda.stream(s):` on a side stream `s`, "
                    "warm up on `s`, and capture with `torch.cuda.graph(g, stream=s)` "
                    "(or use `ddpgraph.prepare_ddp`)",
                    subject="`DistributedDataParallel(...)`",
                    location=ddp.built_at,
                )
            )
    for forward in graph.forwards:
        finding = _warmup_finding(forward, graph)
        if finding is not None:
            known.append(finding)
            break
    return capture_findings(errors, graph.warnings, syncs, known=known)


def script_error_finding(error: BaseException, captured_any: bool) -> Finding:
    """The finding for an error (or `sys.exit`) that ended the script."""
    where = error_location(error)
    if isinstance(error, SystemExit):
        return Finding(
            Code.SCRIPT_FAILED,
            f"the script exited with status {error.code!r}",
            subject="`sys.exit`",
            location=where,
        )
    text = str(error)
    copying = where is not None and ".copy_(" in where.source
    if captured_any and copying and any(m in text for m in _SHAPE_MISMATCH):
        return Finding(
            Code.STATIC_INPUT_CHANGED,
            f"a batch of another shape was copied into a captured input: {first_line(error)}",
            "a graph replays fixed shapes: keep every batch the same shape (for example "
            "`drop_last=True` in the DataLoader) or run the odd batch eagerly",
            subject="static input `copy_`",
            location=where,
        )
    return Finding(Code.SCRIPT_FAILED, first_line(error), location=where)


def _warmup_finding(forward: DdpForward, graph: Graph) -> Finding | None:
    k, done = forward.number, forward.iterations_before
    if done >= MIN_WARMUP_ITERATIONS and is_capturable_forward(k):
        return None
    needed = max(MIN_WARMUP_ITERATIONS, k - 1 + steps_until_capturable([k - 1], 1))
    return Finding(
        Code.WARMUP_TOO_SHORT,
        f"the capture recorded DDP forward number {k}, after {done} iteration"
        f"{'' if done == 1 else 's'} with backward; DDP's reducer needs {needed} before a "
        "capture (it rebuilds buckets on iteration 2 and synchronises with the host to sample "
        "statistics on iterations 1-10 and every 100th)",
        f"run at least {needed} full iterations (forward and backward, grad enabled) on the "
        "capture stream before capturing, and do not capture on an iteration n with "
        "n % 100 in (0, 1)",
        subject="capture",
        location=graph.location,
    )
