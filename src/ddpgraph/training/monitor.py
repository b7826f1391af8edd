"""`NonFiniteMonitor`: learning that the loss became NaN or inf, one step later, without
stalling the step.

Reading a loss on the host (`loss.item()`) makes the host wait for the GPU: a CUDA graph
cannot record that, and outside the graph it stops the host from queueing the next
step. The monitor splits the reading in two:

* inside the step, `record(loss, grad_norm=norm)` writes the values and whether each is
  finite into a small device buffer, gathered from every rank with one tiny all-gather,
  so that every rank holds every rank's values;
* after each call of the step, `after_step()` queues a non-blocking copy of that buffer
  into pinned host memory and a CUDA event behind it, then reads the copy queued after
  the previous call. By then the GPU has usually finished that step; if not, the host
  waits for that step only, while the step just queued keeps the GPU busy.

The host learns about step n while step n+1 runs: at most one step late. Every rank reads
the same gathered values, so with `action="raise"` all ranks raise at the same call and
none is left waiting in a collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from ..ddp.process import current_rank
from ..errors import DdpGraphError, usage_error, warn
from ..findings import Code, Finding

Action = Literal["raise", "warn", "report"]


@dataclass(frozen=True)
class StepValues:
    """What one step recorded, read on the host one step later."""

    step: int  # 0-based: the number of `after_step()` calls before this step's
    values: dict[str, float]  # this rank's values (a non-scalar tensor: its mean)
    per_rank: list[dict[str, float]]
    nonfinite_ranks: tuple[int, ...]  # ranks where a recorded tensor held an inf or NaN

    @property
    def finite(self) -> bool:
        return not self.nonfinite_ranks


@dataclass
class _Slot:
    host: torch.Tensor
    event: torch.cuda.Event | None
    step: int | None = None
    read: bool = False


@dataclass
class _Buffers:
    names: list[str]
    local: torch.Tensor  # float64 [2n]: n values, then n flags (1.0 = non-finite)
    gathered: torch.Tensor  # float64 [world * 2n]
    slots: list[_Slot] = field(default_factory=list)


class NonFiniteMonitor:
    """Watches values recorded inside a (captured) step for NaN and inf, on every rank.

        monitor = ddpgraph.NonFiniteMonitor(action="raise")
        def train_step(x, y):
            ...
            norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            monitor.record(loss, grad_norm=norm)     # device work only
            opt.step()
            return loss.detach()
        step = ddpgraph.capture_step(train_step, model=ddp, optimizer=opt)
        for x, y in loader:
            step(x, y)
            report = monitor.after_step()            # the previous step, or None
            if report is not None and report.step % 100 == 0:
                print(report.values)                 # logging without a sync per step
        monitor.finish()                             # the last step

    Arguments:
        action: what `after_step` does when a recorded value of some rank is NaN or inf:
            "raise" `DdpGraphError` (code NON_FINITE_LOSS) on every rank, "warn" once
            (rank 0), or "report" (only return the values; `nonfinite_steps` lists them).
        all_ranks: gather every rank's values inside the step (one small all-gather on
            the default process group, or `group`). Turn it off only if you handle ranks
            that disagree yourself.
        group: the process group to gather over.

    Record once per step, with the same names every step. Call `after_step()` once after
    every call of the step, on every rank.
    """

    def __init__(
        self,
        *,
        action: Action = "raise",
        all_ranks: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if action not in ("raise", "warn", "report"):
            raise usage_error(
                "`NonFiniteMonitor(action=...)`",
                f"expected 'raise', 'warn' or 'report', got {action!r}",
                "use action='raise' to stop training, 'warn' or 'report' to go on",
            )
        self.action: Action = action
        self._group = group
        self._all_ranks = all_ranks
        # Set at the first `record`, when the process group surely exists: row r of the
        # gathered buffer comes from rank `_row_ranks[r]`.
        self._gather = False
        self._world = 1
        self._own_row = 0
        self._row_ranks: list[int] = []
        self._buffers: _Buffers | None = None
        self._steps = 0
        self._warned = False
        self.nonfinite_steps: list[StepValues] = []

    def record(self, loss: torch.Tensor, **values: torch.Tensor) -> torch.Tensor:
        """Inside the step: record `loss` and other named tensors (a gradient norm, say).

        Device work only (and the all-gather). Returns a 0-dim bool device tensor, True
        when a recorded tensor of any rank holds a NaN or inf, for use inside the step.
        """
        names = ["loss", *values]
        tensors = [loss, *values.values()]
        for name, t in zip(names, tensors, strict=True):
            if not isinstance(t, torch.Tensor):
                raise usage_error(
                    f"`NonFiniteMonitor.record({name}=...)`",
                    f"expected a tensor, got {type(t).__name__}",
                    "record the tensor itself, not a Python number (reading one syncs)",
                )
        buffers = self._buffers or self._allocate(names, loss.device)
        if names != buffers.names:
            raise usage_error(
                "`NonFiniteMonitor.record`",
                f"expected the values {buffers.names} recorded at the first step, got {names}",
                "record the same names every step",
            )
        n = len(names)
        with torch.no_grad():
            detached = [t.detach() for t in tensors]
            buffers.local[:n].copy_(torch.stack([t.double().mean() for t in detached]))
            bad = torch.stack([torch.logical_not(torch.isfinite(t).all()) for t in detached])
            buffers.local[n:].copy_(bad.double())
            if self._gather and self._world > 1:
                _all_gather(buffers.gathered, buffers.local, self._group)
            else:
                buffers.gathered.copy_(buffers.local)
            return buffers.gathered.view(self._world, 2 * n)[:, n:].amax() > 0

    def after_step(self) -> StepValues | None:
        """After each call of the step: queue this step's values for the host and return
        the previous step's (None after the first call). Applies `action` to them."""
        buffers = self._require_buffers()
        slot = buffers.slots[self._steps % 2]
        slot.host.copy_(buffers.gathered, non_blocking=slot.event is not None)
        if slot.event is not None:
            slot.event.record()
        slot.step, slot.read = self._steps, False
        self._steps += 1
        previous = buffers.slots[self._steps % 2]
        return (
            self._read(previous, buffers)
            if previous.step is not None and not previous.read
            else None
        )

    def finish(self) -> StepValues | None:
        """Read the last step now (waiting for it); None if it was read already."""
        buffers = self._require_buffers()
        last = buffers.slots[(self._steps - 1) % 2]
        return self._read(last, buffers) if last.step is not None and not last.read else None

    # ----------------------------------------------------------------- internals
    def _allocate(self, names: list[str], device: torch.device) -> _Buffers:
        self._gather = self._all_ranks and dist.is_available() and dist.is_initialized()
        self._world = dist.get_world_size(self._group) if self._gather else 1
        self._own_row = dist.get_rank(self._group) if self._gather else 0
        self._row_ranks = list(range(self._world)) if self._gather else [current_rank()]
        size = 2 * len(names)
        local = torch.zeros(size, dtype=torch.float64, device=device)
        gathered = torch.zeros(self._world * size, dtype=torch.float64, device=device)
        on_cuda = device.type == "cuda"
        slots = [
            _Slot(
                torch.zeros(self._world * size, dtype=torch.float64, pin_memory=on_cuda),
                torch.cuda.Event() if on_cuda else None,
            )
            for _ in range(2)
        ]
        self._buffers = _Buffers(names, local, gathered, slots)
        return self._buffers

    def _require_buffers(self) -> _Buffers:
        if self._buffers is None:
            raise usage_error(
                "`NonFiniteMonitor.after_step`",
                "nothing was recorded yet",
                "call `monitor.record(loss)` inside the step function, "
                "then `after_step()` after each call",
            )
        return self._buffers

    def _read(self, slot: _Slot, buffers: _Buffers) -> StepValues:
        if slot.event is not None:
            slot.event.synchronize()
        slot.read = True
        n = len(buffers.names)
        rows = slot.host.view(self._world, 2 * n).tolist()
        per_rank = [dict(zip(buffers.names, row[:n], strict=True)) for row in rows]
        bad = tuple(self._row_ranks[r] for r, row in enumerate(rows) if any(f > 0 for f in row[n:]))
        assert slot.step is not None
        report = StepValues(slot.step, per_rank[self._own_row], per_rank, bad)
        if not report.finite:
            self.nonfinite_steps.append(report)
            self._act(report)
        return report

    def _act(self, report: StepValues) -> None:
        if self.action == "report":
            return
        finding = nonfinite_finding(report)
        if self.action == "raise":
            raise DdpGraphError(finding)
        if not self._warned and current_rank() == 0:
            self._warned = True
            warn(
                f"{finding.format()}\nTraining goes on; later non-finite steps are listed in "
                "`monitor.nonfinite_steps` (warned once)."
            )


def nonfinite_finding(report: StepValues) -> Finding:
    ranks = ", ".join(str(r) for r in report.nonfinite_ranks)
    first = report.nonfinite_ranks[0]
    shown = report.per_rank[first] if len(report.per_rank) > 1 else report.values
    values = ", ".join(f"{k}={_fmt(v)}" for k, v in shown.items())
    return Finding(
        Code.NON_FINITE_LOSS,
        f"a value recorded at step {report.step} is NaN or infinite on rank"
        f"{'s' if len(report.nonfinite_ranks) > 1 else ''} {ranks} ({values} on rank {first})",
        subject="`NonFiniteMonitor`",
        ranks=report.nonfinite_ranks,
    )


def _fmt(value: float) -> str:
    return f"{value:.6g}" if math.isfinite(value) else str(value)


def _all_gather(output: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    # `all_gather_single` replaces `all_gather_into_tensor` in newer PyTorch.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)
