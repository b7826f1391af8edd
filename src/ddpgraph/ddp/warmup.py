"""When DDP's reducer allows a capture: the warm-up arithmetic.

DDP's reducer counts forward passes that will be followed by a gradient sync
(`num_iterations_`, incremented in `prepare_for_forward`). On some of them it touches
the host:

* at the start of forward number k it reads the CUDA timer events of iteration k-1
  when iteration k-1 was sampled, which waits on them (`Logger::set_runtime_stats_and_log`);
* during forward and backward number k it records timer events when k is sampled;
* it rebuilds its buckets in forward number 2 (after the first backward).

Iteration n is sampled when 1 <= n <= 10 or n is a multiple of the sample rate (100 by
default). A capture may therefore only record forwards k for which neither k nor k-1 is
sampled: k >= 12 and k % 100 not in (0, 1). The reducer source calls this
`should_collect_runtime_stats`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import DdpGraphUsageError
from ..findings import Code, Finding

if TYPE_CHECKING:
    from .build import ForwardCounter

FIRST_SAMPLED_ITERATIONS = 10
DEFAULT_SAMPLE_RATE = 100
# With a fresh DDP model, forward 12 is the first capturable one: 11 warm-up iterations.
MIN_WARMUP_ITERATIONS = FIRST_SAMPLED_ITERATIONS + 1


def is_sampled(iteration: int, sample_rate: int = DEFAULT_SAMPLE_RATE) -> bool:
    """Whether the reducer records runtime statistics on `iteration` (1-based)."""
    return iteration > 0 and (iteration <= FIRST_SAMPLED_ITERATIONS or iteration % sample_rate == 0)


def is_capturable_forward(forward: int, sample_rate: int = DEFAULT_SAMPLE_RATE) -> bool:
    """Whether DDP forward number `forward` (1-based) touches no host-synchronising timer."""
    return not is_sampled(forward - 1, sample_rate) and not is_sampled(forward, sample_rate)


def step_is_capturable(
    forwards_before: int, forwards_per_step: int, sample_rate: int = DEFAULT_SAMPLE_RATE
) -> bool:
    """Whether a step that runs `forwards_per_step` synced DDP forwards can be captured
    when `forwards_before` have already run."""
    return all(
        is_capturable_forward(forwards_before + j, sample_rate)
        for j in range(1, forwards_per_step + 1)
    )


def steps_until_capturable(
    forwards_before: Sequence[int],
    forwards_per_step: int,
    sample_rate: int = DEFAULT_SAMPLE_RATE,
) -> int:
    """The fewest further eager steps after which every rank can capture its next step.

    `forwards_before` holds each rank's count: ranks normally agree, but if they do not,
    the answer still makes all of them capture on the same call.
    """
    if forwards_per_step <= 0:
        return 0
    # Sampled iterations are at most 2 in a row past the first 11, so the search is short;
    # the bound only guards against a sample rate of 1, where nothing is capturable.
    for extra in range(0, 4 * sample_rate + FIRST_SAMPLED_ITERATIONS + 2):
        if all(
            step_is_capturable(c + extra * forwards_per_step, forwards_per_step, sample_rate)
            for c in forwards_before
        ):
            return extra
    raise ValueError(
        f"no capturable iteration with sample rate {sample_rate} and "
        f"{forwards_per_step} forwards per step"
    )


def default_warmup_steps(forwards_before: int, sample_rate: int = DEFAULT_SAMPLE_RATE) -> int:
    """Warm-up steps needed before capture, assuming one synced forward per step, and
    never fewer than one (the last warm-up step is the host-sync probe)."""
    return 1 + steps_until_capturable([forwards_before + 1], 1, sample_rate)


def checked_warmup(
    is_ddp: bool, counter: ForwardCounter | None, warmup_steps: int | None, without_ddp: int
) -> int:
    """The warm-up steps of a step whose model is DDP (`is_ddp`, its reducer's iterations
    counted by `counter`) or not (`without_ddp` steps): the default for it, or the one
    given; WARMUP_TOO_SHORT (a usage error) when DDP needs more than given."""
    forwards = counter.count if counter else 0
    if warmup_steps is None:
        return default_warmup_steps(forwards) if is_ddp else without_ddp
    exact = counter is not None and counter.exact
    if is_ddp and exact and forwards + warmup_steps < MIN_WARMUP_ITERATIONS:
        raise DdpGraphUsageError(
            Finding(
                Code.WARMUP_TOO_SHORT,
                f"expected at least {MIN_WARMUP_ITERATIONS - forwards} warm-up steps for "
                f"this DDP model ({forwards} iterations run so far), got {warmup_steps}",
                f"use `warmup_steps={MIN_WARMUP_ITERATIONS - forwards}` or more, or leave it "
                "out for the default",
                subject="`capture_step(warmup_steps=...)`",
            )
        )
    return warmup_steps
