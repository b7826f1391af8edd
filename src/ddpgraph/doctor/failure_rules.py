"""The rules for a capture that raised, and for an error that ended the script.

A failed capture is explained by this rank's own evidence first (a DDP model built on the
default stream, a DDP forward recorded before the reducer was ready), then by the shared
diagnosis of `ddpgraph.probe.diagnose` (host syncs, the errors' text), which `capture_step`
uses as well. An error that ended the script is a NO_CUDA where CUDA raised it on a
machine without a GPU, the error's own code where ddpgraph raised it, a
STATIC_INPUT_CHANGED where a write into a graph's input raised it (the instrumentation
saw the write), and SCRIPT_FAILED otherwise.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Sequence

from ..backends.capture_mode import TORCH_DEFAULT_MODE
from ..ddp.warmup import MIN_WARMUP_ITERATIONS, is_capturable_forward, steps_until_capturable
from ..errors import DdpGraphError
from ..findings import Code, Finding, Location
from ..probe.code_origin import TORCH_DIR, under
from ..probe.diagnose import capture_findings, error_chain, error_location, first_line
from ..probe.syncs import SyncEvent
from .observed import DdpForward, DdpModel, Graph


def capture_failure_findings(
    graph: Graph, errors: Sequence[BaseException], syncs: Sequence[SyncEvent]
) -> list[Finding]:
    """What made the capture of `graph` raise `errors`."""
    known: list[Finding] = []
    other_threads = other_thread_finding(graph)
    if other_threads is not None:
        known.append(other_threads)
    ddps = list({id(f.ddp): f.ddp for f in graph.forwards}.values())
    for ddp in ddps:
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
    return capture_findings(
        errors,
        graph.warnings,
        syncs,
        known=known,
        accumulators_on_default=_accumulators_on_default(graph, ddps),
    )


def other_thread_finding(graph: Graph) -> Finding | None:
    """OTHER_THREAD_IN_CAPTURE when other threads called CUDA while `graph` was recorded in
    the "global" mode, where any thread's unsafe call invalidates the capture; in the
    other modes only the capturing thread's own calls can."""
    if graph.mode != TORCH_DEFAULT_MODE or not graph.other_threads:
        return None
    calls = "; ".join(c.describe() for c in graph.other_threads)
    return Finding(
        Code.OTHER_THREAD_IN_CAPTURE,
        f"the capture began in CUDA's \"global\" mode (`torch.cuda.graph`'s default), where an "
        f"unsafe CUDA call from any thread invalidates it, and while it was recorded {calls}",
        'pass `capture_error_mode="thread_local"` to `torch.cuda.graph(...)` (or to '
        "`CUDAGraph.capture_begin`): CUDA then refuses only this thread's own unsafe calls, and "
        "the other thread keeps working. `ddpgraph.capture_step` captures that way already: a "
        "step it captures needs no change",
        subject="capture",
        location=graph.location,
    )


def _accumulators_on_default(graph: Graph, ddps: list[DdpModel]) -> bool | None:
    """Whether the gradient accumulators the capture's backward reached belong to the
    default stream: a DDP model's to the stream it was built on (its reducer holds them
    from construction on); without DDP, a model's to the stream of its first backward."""
    streams = [d.built_on for d in ddps] if ddps else [graph.backward_stream]
    if any(s is None for s in streams):
        return None
    return any(s is not None and s.is_default for s in streams)


def script_error_finding(
    error: BaseException, *, input_write: Finding | None = None, needs_gpu: bool = False
) -> Finding:
    """The finding for an error (or `sys.exit`) that ended the script.

    `input_write` is the finding the instrumentation made when this error was raised by
    a write into a graph's input; `needs_gpu` says that it was raised by CUDA on a
    machine without one.
    """
    where = error_location(error)
    if isinstance(error, SyntaxError) and error.filename and error.lineno:
        # Raised compiling the script: the line is the error's own, not a frame's.
        where = Location(error.filename, error.lineno, (error.text or "").strip())
    if needs_gpu:
        return no_gpu_finding(
            f"`{where.source}` needs CUDA ({first_line(error)})" if where else first_line(error),
            where,
        )
    if isinstance(error, DdpGraphError):
        # ddpgraph's own errors carry their cause and a stable code.
        found = error.finding
        return Finding(
            found.code, found.happened, found.fix, found.subject, found.location or where
        )
    if isinstance(error, SystemExit):
        return Finding(
            Code.SCRIPT_FAILED,
            f"the script exited with status {error.code!r}",
            subject="`sys.exit`",
            location=where,
        )
    if input_write is not None:
        return input_write
    return Finding(Code.SCRIPT_FAILED, first_line(error), location=where)


def no_gpu_finding(what: str, where: Location | None) -> Finding:
    """NO_CUDA, said plainly: the doctor checked nothing, because there is no GPU."""
    return Finding(
        Code.NO_CUDA,
        f"nothing was checked because there is no GPU: torch.cuda.is_available() is False "
        f"here, and {what}",
        "run `ddpgraph doctor` on a machine with an NVIDIA GPU and a CUDA build of PyTorch",
        subject="CUDA",
        location=where,
    )


def raised_by_cuda(error: BaseException) -> bool:
    """Whether `error`, or one it was raised while handling, came out of `torch.cuda`
    (its lazy initialisation, a stream, a graph: all fail there without a GPU)."""
    cuda_dir = os.path.join(TORCH_DIR, "cuda")
    for link in error_chain(error):
        stack = traceback.extract_tb(link.__traceback__) if link.__traceback__ else []
        if any(under(os.path.abspath(f.filename), (cuda_dir,)) for f in stack):
            return True
    return False


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
