"""What happens when the graph cannot be used: eager steps, or an error, as the user chose.

Two occasions, one policy (`OnFailure`): a capture that is given up (`fall_back`, for
the whole step from then on) and a single call the recorded graph cannot serve because
its arguments differ from the recorded ones (`UnservedCalls`). Under "eager" both keep
training with eager steps and warn; under "raise" both raise the finding. The captured
training step and the captured evaluation share them, so the two say the same thing.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Literal

from ..ddp.process import current_rank
from ..errors import DdpGraphError, usage_error
from ..errors import warn as warn_user
from ..findings import Code, Finding

OnFailure = Literal["eager", "raise"]
log = logging.getLogger("ddpgraph")


def check_policies(api: str, on_failure: object, on_input_change: object) -> None:
    """Refuse an `on_failure` / `on_input_change` value that is neither "eager" nor "raise"."""
    for name, value in (("on_failure", on_failure), ("on_input_change", on_input_change)):
        if value not in ("eager", "raise"):
            raise usage_error(
                f"`{api}({name}=...)`",
                f"expected 'eager' or 'raise', got {value!r}",
                f"use {name}='eager' to keep going with eager steps or {name}='raise' to stop",
            )


def fall_back(
    finding: Finding,
    on_failure: OnFailure,
    *,
    continues: str,
    warn: bool = True,
) -> None:
    """What giving up a capture means to the user: under `on_failure="raise"` an error (no
    GPU is not a failure: the same script is meant to run on CPU), otherwise a warning on
    rank 0 only (every rank gives up together, and one message is enough) saying that
    `continues` happens instead."""
    if on_failure == "raise" and finding.code is not Code.NO_CUDA:
        raise DdpGraphError(finding)
    if warn and current_rank() == 0:
        warn_user(f"{finding.format()}\n{continues}")


def capture_again(finding: Finding) -> None:
    """What capturing a step again means to the user: a line in the log; a warning on
    rank 0 too when the graph had been replaying a frozen Python value (every rank
    captures again together, and one message is enough)."""
    log.warning("%s", finding.format())
    if finding.code is Code.FROZEN_PYTHON_VALUE and current_rank() == 0:
        warn_user(f"{finding.format()}\nThe step is captured again.")


class UnservedCalls:
    """The policy for calls a recording cannot serve: "eager" runs them eagerly and warns
    the first time for each cause (code); "raise" raises the finding. The caller runs the
    eager call (`inputs.replay.run_eager_call`). `first` keeps the first such call's
    finding, warned about or not, so that a step whose calls run eagerly while its graph
    stays says why."""

    def __init__(self, policy: OnFailure) -> None:
        self.policy = policy
        self.warned: set[Code] = set()
        self.first: Finding | None = None

    def seen(self, finding: Finding) -> None:
        if self.first is None:
            self.first = finding

    def admit(self, finding: Finding, what_follows: str) -> None:
        if self.policy == "raise":
            raise DdpGraphError(finding)
        if finding.code not in self.warned:
            self.warned.add(finding.code)
            warn_user(f"{finding.format()}\n{what_follows} (warned once for this cause).")


def awaiting_decision(finding: Finding, decided_at: int) -> Finding:
    """A finding this rank reported, as `reason` gives it until the ranks decide on it (the
    rank runs the step eagerly meanwhile)."""
    return replace(
        finding,
        happened=(
            f"{finding.happened}; this rank runs the step eagerly until the ranks decide together, "
            f"at call {decided_at}"
        ),
    )
