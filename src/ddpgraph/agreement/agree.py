"""Every rank takes the same decision, or none does.

A rank that replays a graph while another runs eagerly, or one that raises while the
others wait in a collective, hangs the job. Each decision point (after the host-sync
probe, after capture) therefore gathers every rank's outcome with one collective and
decides from the gathered list, which is the same on every rank.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..findings import Code, Finding, format_ranks, merge_by_code


class Action(enum.IntEnum):
    """What a rank asks for at a decision point; the ranks take the strongest request."""

    CONTINUE = 0
    RECAPTURE = 1  # drop the graph, warm up and capture again
    EAGER = 2  # drop the graph, run every later step eagerly (or raise, per on_failure)
    RAISE = 3  # raise `DdpGraphError` on every rank


@dataclass
class Outcome:
    """What one rank saw at a decision point. Must stay picklable."""

    rank: int
    ok: bool
    findings: list[Finding] = field(default_factory=list)
    forwards: int = 0  # DDP forwards the reducer has counted so far
    forwards_per_step: int = 0  # counted during the last step
    reducer_needs_reset: bool = False
    action: Action = Action.CONTINUE
    usage_error: bool = False  # the finding is a usage error: every rank raises it
    warmup_steps: int = 0  # the warm-up this rank plans; ranks take the longest
    adds_graph: bool = False  # records a graph for a new signature on this call (`family`)
    step_raised: bool = False  # the step itself raised while recorded: every rank raises


@dataclass
class Decision:
    outcomes: list[Outcome]

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outcomes)

    @property
    def failed_ranks(self) -> list[int]:
        return [o.rank for o in self.outcomes if not o.ok]

    @property
    def findings(self) -> list[Finding]:
        return merge_by_code((o.rank, f) for o in self.outcomes for f in o.findings)

    @property
    def reducer_needs_reset(self) -> bool:
        return any(o.reducer_needs_reset for o in self.outcomes)

    @property
    def action(self) -> Action:
        return max((o.action for o in self.outcomes), default=Action.CONTINUE)

    @property
    def adds_graph(self) -> bool:
        return any(o.adds_graph for o in self.outcomes)

    @property
    def usage_error(self) -> bool:
        return any(o.usage_error for o in self.outcomes)

    @property
    def step_raised(self) -> bool:
        return any(o.step_raised for o in self.outcomes)

    def summary(self) -> Finding:
        """The finding to report for a decision that did not go ahead: the first one, and,
        when only some ranks failed, which ones (the others follow them, so that no rank
        waits alone in a collective)."""
        findings = self.findings
        if not findings:
            return Finding(Code.CAPTURE_FAILED, "capture failed without a finding")
        first = findings[0]
        failed = self.failed_ranks
        if 0 < len(failed) < len(self.outcomes) and first.code is not Code.NO_CUDA:
            happened = (
                f"{first.happened} (only on rank{'s' if len(failed) > 1 else ''} "
                f"{format_ranks(failed)}; every rank takes the same path)"
            )
            return Finding(
                first.code, happened, first.fix, first.subject, first.location, first.ranks
            )
        return first


def agree(
    outcome: Outcome,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> Decision:
    """Gather `outcome` from every rank of `group` (the default group when None).

    Blocks until all ranks arrive; call it at the same point of the step on every rank
    and never while a stream is capturing. Without a process group, this rank decides
    alone.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return Decision([outcome])
    size = dist.get_world_size(group)
    gathered: list[Outcome | None] = [None] * size
    if device is not None and device.type == "cuda":
        # all_gather_object stages through the *current* device, which must be this
        # rank's own GPU for NCCL.
        with torch.cuda.device(device):
            dist.all_gather_object(gathered, outcome, group=group)
    else:
        dist.all_gather_object(gathered, outcome, group=group)
    return Decision([o for o in gathered if o is not None])
