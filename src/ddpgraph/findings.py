"""Stable finding codes and the one message template every error and report uses.

A *finding* is one thing ddpgraph learned about a training step: why it cannot be
captured, why it ran eagerly, or what a user's script did wrong. The same finding
object is what `CapturedStep.reason` holds, what `DdpGraphError` carries, and what
`ddpgraph doctor` prints, so a user can look a code up wherever they met it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field


class Code(str, enum.Enum):
    """Stable identifiers. Never renumber or rename: users search for them."""

    # Capture problems in the user's step or setup.
    DDP_STREAM_MISMATCH = "DDP_STREAM_MISMATCH"
    WARMUP_TOO_SHORT = "WARMUP_TOO_SHORT"
    HOST_SYNC_IN_CAPTURE = "HOST_SYNC_IN_CAPTURE"
    OPTIMIZER_NOT_CAPTURABLE = "OPTIMIZER_NOT_CAPTURABLE"
    GRAD_SCALER_IN_CAPTURE = "GRAD_SCALER_IN_CAPTURE"
    LR_BAKED_INTO_GRAPH = "LR_BAKED_INTO_GRAPH"
    OPTIMIZER_STATE_REPLACED = "OPTIMIZER_STATE_REPLACED"
    STATIC_INPUT_CHANGED = "STATIC_INPUT_CHANGED"
    CAPTURE_RANKS_DISAGREE = "CAPTURE_RANKS_DISAGREE"
    INPUT_SIGNATURE_CHANGED = "INPUT_SIGNATURE_CHANGED"
    UNSUPPORTED_INPUT = "UNSUPPORTED_INPUT"
    MODEL_MODE_CHANGED = "MODEL_MODE_CHANGED"
    MODULE_SETTING_CHANGED = "MODULE_SETTING_CHANGED"
    CAPTURE_FAILED = "CAPTURE_FAILED"
    INPUT_CHANGED_BY_STEP = "INPUT_CHANGED_BY_STEP"
    OPTIMIZER_NOT_PASSED = "OPTIMIZER_NOT_PASSED"
    PARAMETERS_CHANGED = "PARAMETERS_CHANGED"
    UNSUPPORTED_SETUP = "UNSUPPORTED_SETUP"
    OTHER_THREAD_IN_CAPTURE = "OTHER_THREAD_IN_CAPTURE"
    FROZEN_PYTHON_VALUE = "FROZEN_PYTHON_VALUE"
    # The environment.
    NO_CUDA = "NO_CUDA"
    NCCL_TOO_OLD = "NCCL_TOO_OLD"
    TORCH_TOO_OLD = "TORCH_TOO_OLD"
    # Using the API.
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    STEP_CLOSED = "STEP_CLOSED"
    # Running a user's script under `ddpgraph doctor`.
    SCRIPT_FAILED = "SCRIPT_FAILED"
    SCRIPT_TIMED_OUT = "SCRIPT_TIMED_OUT"
    # Training.
    NON_FINITE_LOSS = "NON_FINITE_LOSS"
    REPLAY_TIMED_OUT = "REPLAY_TIMED_OUT"
    PARITY_MISMATCH = "PARITY_MISMATCH"
    RANK_STOPPED = "RANK_STOPPED"


@dataclass(frozen=True)
class CodeInfo:
    title: str
    meaning: str
    fix: str


# One line of meaning and the usual fix per code; findings add the specifics.
CATALOG: dict[Code, CodeInfo] = {
    Code.DDP_STREAM_MISMATCH: CodeInfo(
        "DDP built on another stream than the capture",
        "DDP keeps the AccumulateGrad nodes of the stream it was built on; backward then syncs "
        "that stream with the capture stream, which invalidates the capture.",
        "Build the model with `ddpgraph.prepare_ddp(model, ...)`, or build DDP inside "
        "`with torch.cuda.stream(s):` and warm up and capture on that same side stream `s`.",
    ),
    Code.WARMUP_TOO_SHORT: CodeInfo(
        "Too few DDP iterations before capture",
        "DDP's reducer rebuilds its buckets on iteration 2 and synchronizes with the host to "
        "record runtime statistics on iterations 1-10 and every 100th; capturing one of those "
        "iterations fails.",
        "Run at least 11 full DDP iterations (forward and backward) on the capture stream "
        "before capturing, and do not capture on an iteration n with n % 100 in (0, 1).",
    ),
    Code.HOST_SYNC_IN_CAPTURE: CodeInfo(
        "The host waits for the GPU inside the captured region",
        "An operation that needs a result on the host (`.item()`, printing a tensor, `.cpu()`, "
        "`nonzero`, `if tensor:`) cannot be recorded in a CUDA graph.",
        "Move the operation out of the captured step, or keep the value on the device "
        "(return the tensor and read it after the step).",
    ),
    Code.OPTIMIZER_NOT_CAPTURABLE: CodeInfo(
        "The optimizer cannot run inside a CUDA graph",
        "Its step reads values on the host or keeps state on the CPU.",
        "Use Adam, AdamW, SGD or another torch optimizer that has `capturable=True`; "
        "`ddpgraph.capture_step` switches it to graph-safe mode for you.",
    ),
    Code.GRAD_SCALER_IN_CAPTURE: CodeInfo(
        "torch.amp.GradScaler inside the captured region",
        "GradScaler reads the found-inf flag on the host in `step` and `update`.",
        "Use bf16 autocast, which needs no loss scaling, or keep `scaler.step` / "
        "`scaler.update` out of the captured region.",
    ),
    Code.LR_BAKED_INTO_GRAPH: CodeInfo(
        "A hyper-parameter held as a Python number is frozen into the graph",
        "A float learning rate (or momentum, weight decay, ...) is copied into the kernels "
        "at capture; changing it afterwards has no effect on replays.",
        "Hold the learning rate in a device tensor (`ddpgraph.graph_safe_optimizer` does "
        "this), and step schedulers outside the captured function.",
    ),
    Code.OPTIMIZER_STATE_REPLACED: CodeInfo(
        "State tensors replaced after capture",
        "The graph reads and writes the tensors that existed at capture; `load_state_dict` "
        "or assignment puts new tensors in their place, so replays use stale storage.",
        "Load checkpoints before capture, or through `CapturedStep`, which copies loaded "
        "values into the captured storage.",
    ),
    Code.STATIC_INPUT_CHANGED: CodeInfo(
        "The graph's input tensors did not receive the new data",
        "A replay reads the tensors captured as inputs; new data must be copied into them "
        "with `copy_` before each replay, with the same shape.",
        "Copy each batch into the static input tensors (`static_x.copy_(x)`) before "
        "`replay()`, or let `ddpgraph.capture_step` do the copying.",
    ),
    Code.CAPTURE_RANKS_DISAGREE: CodeInfo(
        "Ranks took different paths",
        "Some ranks captured or replayed while others ran eagerly or failed; their "
        "collectives no longer pair up, which hangs or corrupts the job.",
        "Make the capture decision on all ranks together (`ddpgraph.capture_step` does).",
    ),
    Code.INPUT_SIGNATURE_CHANGED: CodeInfo(
        "The step was called with inputs unlike the captured ones",
        "A CUDA graph replays fixed shapes, dtypes and devices, and the non-tensor "
        "arguments seen at capture.",
        "Keep batches the same shape (for example `drop_last=True` in the DataLoader), or "
        "accept the eager steps that ddpgraph runs for odd batches.",
    ),
    Code.UNSUPPORTED_INPUT: CodeInfo(
        "An argument ddpgraph cannot look inside",
        "Tensors hidden in an unknown object would not be copied into the graph's inputs, "
        "so replays would read stale data.",
        "Pass tensors, numbers, strings, or lists, tuples and dicts of them; unpack custom "
        "batch objects, or register them with `torch.utils._pytree.register_pytree_node`.",
    ),
    Code.MODEL_MODE_CHANGED: CodeInfo(
        "The train/eval mode of the model, or of a module inside it, differs from the captured one",
        "A graph replays the kernels of the modes it was recorded in: dropout and "
        "BatchNorm statistics updates in train mode, none in eval mode.",
        "Call `model.train()` again after evaluation, before the next training step. A "
        "module meant to stay switched (a frozen BatchNorm) is switched before the first "
        "step, or a new step is built after.",
    ),
    Code.MODULE_SETTING_CHANGED: CodeInfo(
        "A float setting of a module inside the model differs from the captured one",
        "A graph replays the values it was recorded with: a dropout probability, a drop-path "
        "rate, a norm's epsilon or a temperature on a module of yours stays the captured one.",
        "Set it before the first step, or build a new step after changing it (`capture_step` "
        "again, once per epoch for a rate ramped by epoch); a number the forward does not "
        "read belongs off the module. Until then, such calls run eagerly.",
    ),
    Code.INPUT_CHANGED_BY_STEP: CodeInfo(
        "The step writes into an argument, or an argument gets a gradient",
        "A replay reads its arguments from the graph's own input buffers: an in-place write "
        "(`count.add_(1)`) or a gradient (`x.grad`) lands there, not in the caller's tensor.",
        "Return the new value instead of writing into the argument, and keep tensors that "
        "need gradients inside the model, not in the step's arguments.",
    ),
    Code.OPTIMIZER_NOT_PASSED: CodeInfo(
        "An optimizer steps inside the step but was not passed to `capture_step`",
        "Its hyper-parameters would be frozen into the graph and its schedule ignored.",
        "Pass every optimizer the step steps: `capture_step(fn, model=..., optimizer=[a, b])`.",
    ),
    Code.PARAMETERS_CHANGED: CodeInfo(
        "The model's parameters changed after capture",
        "A graph trains the parameter storage and the `requires_grad` flags it was recorded with.",
        "ddpgraph captures again after such a change; make it before the first step to avoid that.",
    ),
    Code.CAPTURE_FAILED: CodeInfo(
        "Capture failed for a reason ddpgraph does not recognise",
        "CUDA rejected an operation while the step was being recorded.",
        "Run `ddpgraph doctor your_script.py` for a per-rank diagnosis, and report the "
        "message if it names no cause.",
    ),
    Code.OTHER_THREAD_IN_CAPTURE: CodeInfo(
        "Another thread's CUDA call invalidated the capture",
        "In CUDA's \"global\" capture mode (`torch.cuda.graph`'s default) an unsafe CUDA call "
        "from any thread invalidates the capture: a DataLoader's pin-memory thread pinning the "
        "next batch (`cudaHostAlloc`, `cudaEventQuery`), a thread that synchronises or queries "
        "events.",
        'Capture with `torch.cuda.graph(g, capture_error_mode="thread_local")`: only the '
        "capturing thread's own calls are refused then. `ddpgraph.capture_step` captures that "
        "way already and needs no change.",
    ),
    Code.UNSUPPORTED_SETUP: CodeInfo(
        "A training setup that cannot be captured whole",
        "The training framework runs the step in a way one graph cannot replay (manual "
        "optimization, gradient accumulation across calls, a loss-scaling precision plugin, "
        "a strategy other than DDP); the step runs eagerly.",
        "Use automatic optimization with one optimizer, `accumulate_grad_batches=1` and "
        "bf16 or fp32 precision, or capture your own step with `ddpgraph.capture_step`.",
    ),
    Code.FROZEN_PYTHON_VALUE: CodeInfo(
        "A Python value the step computes would be frozen into the graph",
        "A replay runs no Python: a number the step's Python passes to an operation (a loss "
        "weight from a step counter, a size, an index) or the branch it takes is the one "
        "recorded at capture, repeated by every replay, and Python state outside the step that "
        "it changes (a list it appends to, a counter, an iterator it takes batches from) stops "
        "changing. Calls of the step were seen to differ in such a value, or to change such "
        "state.",
        "Pass the value into the step as a tensor argument, or keep it in a device tensor the "
        "step updates in place; make a branch a tensor operation (`torch.where`) or move it "
        "out of the step.",
    ),
    Code.NO_CUDA: CodeInfo(
        "No CUDA device for this step",
        "CUDA graphs need a CUDA device; the step runs eagerly.",
        "Run on a machine with an NVIDIA GPU and a CUDA build of PyTorch, with the model "
        "on the GPU.",
    ),
    Code.NCCL_TOO_OLD: CodeInfo(
        "NCCL is too old for collectives inside CUDA graphs",
        "NCCL before 2.9.6 cannot be captured reliably.",
        "Install a PyTorch build that ships a newer NCCL.",
    ),
    Code.TORCH_TOO_OLD: CodeInfo(
        "PyTorch is too old",
        "ddpgraph needs PyTorch 2.4 or newer for capturable optimizers with tensor "
        "learning rates and for NCCL capture.",
        "Upgrade PyTorch.",
    ),
    Code.INVALID_ARGUMENT: CodeInfo(
        "Invalid argument",
        "An argument to a ddpgraph function has a value it cannot use.",
        "See the HINT of the message.",
    ),
    Code.STEP_CLOSED: CodeInfo(
        "The captured step was closed",
        "`close()` freed its graphs; it cannot run again.",
        "Create a new step with `ddpgraph.capture_step`.",
    ),
    Code.SCRIPT_FAILED: CodeInfo(
        "The script failed for a reason unrelated to capture",
        "It raised an exception or exited with an error outside any CUDA graph capture, or a "
        "process ended before the script finished.",
        "Fix the error at the line shown; run the script without the doctor to see its "
        "full output.",
    ),
    Code.SCRIPT_TIMED_OUT: CodeInfo(
        "The script did not finish in time",
        "At least one rank was still running when the time limit ran out, usually waiting in "
        "a collective that another rank never joined.",
        "Look at the line each rank was waiting at; make every rank run the same "
        "collectives (capture, replay or eager step) in the same order, or raise `--timeout`.",
    ),
    Code.NON_FINITE_LOSS: CodeInfo(
        "The loss (or another recorded value) became NaN or infinite",
        "A value recorded with `NonFiniteMonitor.record` inside the step held a NaN or inf "
        "on at least one rank; the message names the step and the ranks.",
        "Look at that step's data and learning rate; with fp16, `GraphSafeGradScaler` skips "
        "steps whose gradients overflow; `NonFiniteMonitor(action='report')` keeps training.",
    ),
    Code.REPLAY_TIMED_OUT: CodeInfo(
        "A replayed step did not finish in time",
        "The GPU work of a replay (usually its all-reduce, waiting for a rank that never "
        "joined it) had not finished after `replay_timeout`; c10d's own watchdog does not "
        "see collectives replayed from a graph. The message names the replay and what the "
        "other ranks last reported.",
        "Look at the ranks that launched the fewest replays: they stopped calling "
        "the step (a data loader that hangs, an exception, a branch only some ranks take). "
        "If replays are legitimately this slow, raise `capture_step(replay_timeout=...)`.",
    ),
    Code.PARITY_MISMATCH: CodeInfo(
        "The replayed step computes something else than the same step run eagerly",
        "`capture_step(parity=...)` ran the step once eagerly and once replayed from the same "
        "saved state; parameters or outputs differ by more than the stated tolerance, so the "
        "graph records other kernels (an attention backend chosen differently while capturing, "
        "a nondeterministic kernel) or misses an update.",
        "Read the size in the message: a rounding-sized difference from a nondeterministic "
        "kernel can be allowed with `ParityCheck(rtol=...)`; a large one means the graph is "
        "wrong, so keep training eager (the default answer) and report it.",
    ),
    Code.RANK_STOPPED: CodeInfo(
        "Another rank stopped running the step",
        "A rank's step raised, or the rank stopped calling the step (or called it fewer "
        "times), so a collective of the step (an agreement of the ranks, a replay's or an "
        "eager step's all-reduce) could not complete; the message names the rank and the call.",
        "Look at the named rank's own error. Every rank must call the step the same number "
        "of times: catch an exception raised by the step on every rank or on none.",
    ),
}


# The fix for an INPUT_SIGNATURE_CHANGED whose cause is a non-tensor argument: the
# catalog's fix (batch shapes, `drop_last`) is about tensors and would mislead.
CONSTANT_INPUT_FIX = (
    "Non-tensor arguments (numbers, strings, flags) are fixed at capture. Pass a value that "
    "changes between steps as a tensor (`torch.tensor(value, device=...)`), or keep it the "
    "same in every call; calls with another value run eagerly."
)


def input_change_fix(change: str) -> str:
    """The fix for an INPUT_SIGNATURE_CHANGED finding, from the description of the change
    (`inputs.Signature.describe_change`, which names a non-tensor leaf `argument ...` and a
    tensor `input ...`)."""
    if change.startswith("argument `"):
        return CONSTANT_INPUT_FIX
    return CATALOG[Code.INPUT_SIGNATURE_CHANGED].fix


@dataclass(frozen=True)
class Location:
    """A place in the user's code."""

    filename: str
    lineno: int
    source: str = ""

    def __str__(self) -> str:
        text = f"{self.filename}:{self.lineno}"
        return f"{text}: `{self.source}`" if self.source else text


@dataclass(frozen=True)
class Finding:
    """One diagnosed problem: a stable code, what happened, where, and the fix.

    `ranks` is empty when the finding is about this process only and was not
    gathered from the other ranks.
    """

    code: Code
    happened: str
    fix: str = ""
    subject: str = ""
    location: Location | None = None
    ranks: tuple[int, ...] = field(default=())

    @property
    def title(self) -> str:
        return CATALOG[self.code].title

    @property
    def hint(self) -> str:
        return self.fix or CATALOG[self.code].fix

    def with_ranks(self, ranks: Iterable[int]) -> Finding:
        return Finding(
            self.code, self.happened, self.fix, self.subject, self.location, tuple(sorted(ranks))
        )

    def format(self) -> str:
        """The one template: `[CODE] subject: what happened (where)` then `HINT: fix`."""
        subject = self.subject or self.title
        head = f"[{self.code.value}] {subject}: {self.happened}"
        if self.location is not None:
            head += f" (at {self.location})"
        if self.ranks:
            head += f" [rank{'s' if len(self.ranks) > 1 else ''} {format_ranks(self.ranks)}]"
        return f"{head}\nHINT: {self.hint}"

    def __str__(self) -> str:
        return self.format()


def format_ranks(ranks: Iterable[int]) -> str:
    """`0-3,5` style, so a report for 64 ranks stays one line."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    start = prev = None
    for r in ordered:
        if start is None:
            start = prev = r
        elif prev is not None and r == prev + 1:
            prev = r
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = r
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def merge_by_code(per_rank: Iterable[tuple[int, Finding]]) -> list[Finding]:
    """Group the same finding seen on several ranks into one finding listing them.

    Findings are the same when code, message and location agree; the first seen
    keeps its place, so the report order follows rank 0's order.
    """
    groups: dict[tuple[Code, str, Location | None], tuple[Finding, list[int]]] = {}
    for rank, finding in per_rank:
        key = (finding.code, finding.happened, finding.location)
        if key in groups:
            groups[key][1].append(rank)
        else:
            groups[key] = (finding, [rank])
    return [f.with_ranks(ranks) for f, ranks in groups.values()]
