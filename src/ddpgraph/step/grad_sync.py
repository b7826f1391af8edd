"""Gradient accumulation across calls (`ddp.no_sync()`), which one graph cannot replay.

A step called under `with ddp.no_sync():` on some calls and synchronising on others
runs two different programs: forward and backward without DDP's all-reduce, and the
same with it. One graph replays only the one it recorded, so it would all-reduce on
every call or on none. A graph per kind of call would not do either: its backward adds
into the gradient tensors that existed when it was recorded, and the usual loop
(`zero_grad(set_to_none=True)` after the optimizer step) gives every cycle new ones.

So such a step is refused with UNSUPPORTED_SETUP, on every rank together, and runs
eagerly, as `ddpgraph.accumulate` inside one step (all micro-batches, one all-reduce,
one graph) is the captured way to accumulate. Seen:

* in warm-up, a call whose DDP forwards with grad all ran with the gradient sync off
  (`no_sync()` around the call or inside it): the probe step's agreement refuses;
* once captured, a call made with the sync off (the graph recorded it on): reported,
  agreed at the next decision point, and run eagerly until then, which pairs with the
  peers (an eager `no_sync` call runs no collective, and every rank makes the same
  calls under `no_sync`, as DDP itself needs).

The finding names the user's line: the call of the step made inside `with
ddp.no_sync():`, or, when the step enters `no_sync()` itself, the forward run under it.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..ddp import build as ddp_tools
from ..findings import Code, Finding, Location
from ..frozen.call_lines import line_location
from ..probe.syncs import user_location

_FIX = (
    "accumulate the micro-batches inside one step, `loss = ddpgraph.accumulate(ddp, batch, "
    "loss_fn, micro_batches=M)` between `zero_grad` and `opt.step()`, so that one graph holds "
    "all of them and their one all-reduce; or call the step outside `no_sync()` on every call"
)


def syncs_gradients(model: nn.Module) -> bool:
    """Whether a DDP backward run now would all-reduce (False under `no_sync()`)."""
    return not isinstance(model, DDP) or bool(getattr(model, "require_backward_grad_sync", True))


def accumulation_finding(call: int, what: str, where: Location | None = None) -> Finding:
    return Finding(
        Code.UNSUPPORTED_SETUP,
        f"call {call} of the step {what}, so gradients accumulate across calls and are "
        "all-reduced by a later one; a graph replays one kind of call only, and would "
        "all-reduce on every call or on none",
        _FIX,
        subject="`CapturedStep` with `ddp.no_sync()`",
        location=where,
    )


class GradSyncWatch:
    """Finds calls that leave their gradients for a later call to synchronise."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._counter = ddp_tools.forward_counter(model)
        self._marks = (0, 0)
        # Where the user called the step, when the call started under `no_sync()`.
        self._called_at: Location | None = None
        self.finding: Finding | None = None

    def before_call(self) -> None:
        counter = self._counter
        if counter is not None:
            self._marks = (counter.count, counter.unsynced)
            # `no_sync()` around the call: its line is the caller's (read only then).
            unsynced = not syncs_gradients(self._model)
            self._called_at = user_location() if unsynced else None

    def after_call(self, call: int) -> Finding | None:
        """The finding for this call (kept, the first one only) when its DDP forwards with
        grad all ran without gradient sync."""
        counter = self._counter
        if counter is None or self.finding is not None:
            return self.finding
        synced, unsynced = counter.count - self._marks[0], counter.unsynced - self._marks[1]
        if unsynced and not synced:
            # The step's call inside `with ddp.no_sync():`, or, entered inside the step,
            # the forward that ran under it.
            where = self._called_at or line_location(counter.unsynced_line)
            self.finding = accumulation_finding(
                call, "ran DDP's forward and backward under `no_sync()`", where
            )
        return self.finding

    def entered_unsynced(self, call: int) -> Finding | None:
        """The finding for a call made under `no_sync()` after capture (a replay runs no
        forward hook, so the flag is read as the call starts)."""
        if syncs_gradients(self._model):
            return None
        return accumulation_finding(
            call,
            "is made under `no_sync()` while the graph synchronises gradients",
            user_location(),
        )

    def reset(self) -> None:
        self.finding = None
