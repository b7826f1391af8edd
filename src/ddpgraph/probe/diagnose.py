"""Naming the cause of a failed capture from what was seen while it was being recorded.

CUDA reports most capture failures with the same message, "operation failed due to a
previous error during capture", raised when the recording is closed. The evidence that
tells the causes apart is elsewhere:

* the errors raised while recording, earliest first, each with its Python stack
  (the one raised by `capture_end` carries the earlier one as its `__context__`);
* the warnings PyTorch raised meanwhile (DDP's gradient accumulators on another
  stream: "The AccumulateGrad node's stream does not match ..."; it names no stream,
  and it is a cause only where those accumulators belong to the default stream);
* the host synchronisations seen by the sync probe, each with its stack.

Evidence that names one cause (a synchronisation with its line, the optimizer's
"capturable is False", the stream warning) is *specific*; an error that only says
the capture broke is *generic* and is reported only when nothing specific was seen.
`capture_step` and `ddpgraph doctor` both use these rules.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..backends.graph import CaptureError
from ..findings import Code, Finding, Location
from .code_origin import location_of, user_frame
from .syncs import SyncEvent, classify, host_sync_finding

STREAM_WARNING = "AccumulateGrad node's stream does not match"
# Newer PyTorch raises this from backward instead of letting the capture break.
_STALE_STREAM = "stale reference to the default stream"
# The legacy default stream was pulled into the capture (DDP built on it).
_LEGACY_STREAM = "legacy stream depend on a capturing"
_CAPTURE_UNSUPPORTED = (
    "operation not permitted when stream is capturing",
    "cudaErrorStreamCaptureUnsupported",
)
_CAPTURE_INVALIDATED = (
    "operation failed due to a previous error during capture",
    "cudaErrorStreamCaptureInvalidated",
)


_UNREGISTERED_GENERATOR = "Attempt to increase offset for a CUDA generator not in capture mode"


@dataclass(frozen=True)
class _CauseCandidate:
    finding: Finding
    specific: bool


def error_chain(error: BaseException) -> list[BaseException]:
    """`error` and the errors it was raised while handling, earliest first."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not e for e in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain[::-1]


def error_location(error: BaseException) -> Location | None:
    """The user's line in the stack the error was raised through."""
    stack = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
    return location_of(user_frame(stack))


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    head = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {head}" if head else type(error).__name__


def _stream_finding(why: str, where: Location | None) -> Finding:
    return Finding(
        Code.DDP_STREAM_MISMATCH,
        f"backward synchronised the stream DDP was built on with the capture stream ({why})",
        location=where,
    )


def _from_error(error: BaseException) -> _CauseCandidate:
    text = f"{type(error).__name__}: {error}"
    where = error_location(error)
    head = first_line(error)
    if _STALE_STREAM in text or _LEGACY_STREAM in text:
        return _CauseCandidate(_stream_finding(f"PyTorch raised: {head}", where), True)
    if "capturable" in text and ("False" in text or "capturable=True" in text):
        return _CauseCandidate(Finding(Code.OPTIMIZER_NOT_CAPTURABLE, head, location=where), True)
    if _UNREGISTERED_GENERATOR in text:
        return _CauseCandidate(
            Finding(
                Code.CAPTURE_FAILED,
                f"the step draws from a torch.Generator not registered with the graph ({head})",
                "pass it to `capture_step(..., generators=[g])`, or to "
                "`graph.register_generator_state(g)` before capturing by hand",
                location=where,
            ),
            True,
        )
    if any(marker in text for marker in _CAPTURE_UNSUPPORTED):
        stack = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
        by_stack = classify(stack, during_capture=True)
        if by_stack is not None and by_stack.code is not Code.HOST_SYNC_IN_CAPTURE:
            return _CauseCandidate(by_stack, True)
        # CUDA raises this for any operation it cannot record, not only host waits.
        return _CauseCandidate(host_sync_finding(stack, getattr(error, "setting", None)), False)
    if any(marker in text for marker in _CAPTURE_INVALIDATED):
        return _CauseCandidate(
            Finding(Code.CAPTURE_FAILED, f"CUDA invalidated the capture: {head}", location=where),
            False,
        )
    return _CauseCandidate(Finding(Code.CAPTURE_FAILED, head, location=where), False)


def capture_findings(
    errors: Iterable[BaseException],
    warnings_seen: Iterable[str] = (),
    syncs: Sequence[SyncEvent] = (),
    *,
    known: Sequence[Finding] = (),
    accumulators_on_default: bool | None = None,
) -> list[Finding]:
    """Every cause the evidence of one failed capture names, most specific first.

    `errors` are the errors raised while recording (each is expanded to the chain it
    was raised in); `warnings_seen` the warning texts; `syncs` the probe's events;
    `known` the specific findings the caller established by its own means (they come
    first, and win over a finding of the same cause). Never empty: without evidence
    the finding is CAPTURE_FAILED.

    `accumulators_on_default` says whether the gradient accumulators belong to the
    default stream, where the caller knows (the stream DDP was built on). PyTorch's
    stream warning fires whenever they belong to another stream than the one backward
    runs on, which is harmless unless that stream is the default one (a DDP built
    inside `torch.cuda.stream(s)` and captured on the graph's own stream captures fine):
    the warning names the cause only when they are, or when nothing says where they are.
    """
    candidates: list[_CauseCandidate] = []
    seen: list[BaseException] = []
    for error in errors:
        for link in error_chain(error):
            if all(link is not e for e in seen):
                seen.append(link)
                candidates.append(_from_error(link))
    warned = [w for w in warnings_seen if STREAM_WARNING in w]
    if warned and accumulators_on_default is not False:
        where = next((c.finding.location for c in candidates), None)
        candidates.insert(
            0, _CauseCandidate(_stream_finding(f"PyTorch warned: {STREAM_WARNING}", where), True)
        )
    for event in syncs:
        finding = classify(event.stack, during_capture=True)
        if finding is not None:
            candidates.append(_CauseCandidate(finding, True))
    specific = _unique([*known, *(c.finding for c in candidates if c.specific)])
    if specific:
        return specific
    if candidates:
        return [candidates[0].finding]
    return [Finding(Code.CAPTURE_FAILED, "the capture failed without an error or a warning")]


def _unique(findings: list[Finding]) -> list[Finding]:
    """One finding per code and place; one per code for the causes that have one place."""
    once_per_code = {Code.DDP_STREAM_MISMATCH, Code.WARMUP_TOO_SHORT}
    kept: dict[object, Finding] = {}
    for f in findings:
        key: object = f.code if f.code in once_per_code else (f.code, f.location)
        kept.setdefault(key, f)
    return list(kept.values())


def raised_by_step(err: CaptureError) -> bool:
    """Whether a recording failed because the step itself raised, as it would have raised
    eagerly: an exception other than a RuntimeError (the type PyTorch and CUDA raise for
    what cannot be recorded, and what ddpgraph's CPU backends raise for it too), with the
    recording still valid when it was closed."""
    cause = err.cause
    return cause is not None and err.end_error is None and not isinstance(cause, RuntimeError)


def step_raised_finding(error: BaseException, call: int) -> Finding:
    """What the other ranks are told when this rank's step raised on the capture call."""
    return Finding(
        Code.RANK_STOPPED,
        f"the step raised `{first_line(error)}` on call {call}, the capture call; every rank "
        "raises on this call, as none can go on without it (training state as before the call)",
        "fix the error on the rank named; where the step raises on purpose, catch the "
        "exception on every rank or on none, so that all of them make the same calls",
        subject="`CapturedStep` call",
        location=error_location(error),
    )


def finding_from_error(error: BaseException, warnings_seen: Iterable[str] = ()) -> Finding:
    """The finding for one exception raised while a step was being recorded."""
    return capture_findings([error], warnings_seen)[0]


def finding_from_capture_error(
    err: CaptureError, warnings_seen: Iterable[str] = (), syncs: Sequence[SyncEvent] = ()
) -> Finding:
    """The main finding for a failed `CaptureError` (the first error raised while
    recording, then the one raised when the recording was closed)."""
    errors = [e for e in (err.cause, err.end_error) if e is not None]
    return capture_findings(errors, warnings_seen, syncs)[0]
