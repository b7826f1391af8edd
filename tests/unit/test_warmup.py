"""The reducer-sampling arithmetic that decides when a DDP step may be captured.

Iteration n is sampled when 1 <= n <= 10 or n % 100 == 0; forward k may be recorded
when neither k nor k - 1 is sampled. The oracle below restates that rule
independently, and the functions are checked against it by brute force.
"""

from __future__ import annotations

import itertools

import pytest

from ddpgraph.ddp.warmup import (
    default_warmup_steps,
    is_capturable_forward,
    is_sampled,
    step_is_capturable,
    steps_until_capturable,
)


def _sampled(n: int, rate: int = 100) -> bool:
    return 1 <= n <= 10 or (n > 0 and n % rate == 0)


def _recordable(k: int, rate: int = 100) -> bool:
    return not _sampled(k, rate) and not _sampled(k - 1, rate)


def test_is_sampled() -> None:
    assert [n for n in range(0, 320) if is_sampled(n)] == [*range(1, 11), 100, 200, 300]
    assert is_sampled(50, sample_rate=25)
    assert not is_sampled(60, sample_rate=25)


def test_first_capturable_forward_of_a_fresh_model_is_12() -> None:
    assert not is_capturable_forward(11)  # forward 11 reads iteration 10's timers
    assert is_capturable_forward(12)
    assert next(k for k in range(1, 1000) if is_capturable_forward(k)) == 12


def test_every_hundredth_iteration_blocks_two_forwards() -> None:
    assert not is_capturable_forward(100)
    assert not is_capturable_forward(101)
    assert is_capturable_forward(102)
    assert is_capturable_forward(99)
    assert [k for k in range(12, 310) if not is_capturable_forward(k)] == [
        100,
        101,
        200,
        201,
        300,
        301,
    ]


@pytest.mark.parametrize("rate", [100, 7])
def test_is_capturable_forward_matches_the_rule(rate: int) -> None:
    for k in range(1, 420):
        assert is_capturable_forward(k, rate) == _recordable(k, rate), k


def test_step_is_capturable_needs_every_forward_of_the_step() -> None:
    assert not step_is_capturable(10, 2)  # records forwards 11 and 12; 11 is blocked
    assert step_is_capturable(11, 2)  # 12 and 13
    assert not step_is_capturable(98, 2)  # 99 and 100
    assert not step_is_capturable(99, 1)  # 100
    assert step_is_capturable(101, 2)  # 102 and 103


@pytest.mark.parametrize(
    ("counts", "per_step", "extra"),
    [
        ([0], 1, 11),  # a fresh model: 11 eager steps, the 12th is captured
        ([0, 0], 1, 11),
        ([0], 2, 6),  # forwards 13 and 14
        ([0], 3, 4),  # forwards 13, 14, 15
        ([96], 2, 0),  # 97 and 98
        ([98], 2, 2),  # 99-100 and 101-102 are blocked; 103-104 are not
        ([99], 1, 2),  # 100 and 101 are blocked
        # Ranks whose counts differ must still capture on the same call: each alone
        # would capture after 0 and 2 steps, together only after 3.
        ([98, 99], 1, 3),
        ([0, 5], 1, 11),
        ([5, 0], 1, 11),
        ([0], 0, 0),  # no synced forward: nothing to wait for
    ],
)
def test_steps_until_capturable(counts: list[int], per_step: int, extra: int) -> None:
    assert steps_until_capturable(counts, per_step) == extra


def _all_recordable(counts: list[int], extra: int, per_step: int) -> bool:
    return all(
        _recordable(c + extra * per_step + j) for c in counts for j in range(1, per_step + 1)
    )


def test_steps_until_capturable_is_the_first_common_capturable_step() -> None:
    for a, b in itertools.product(range(0, 215, 3), range(90, 110)):
        for per_step in (1, 2, 3):
            extra = steps_until_capturable([a, b], per_step)
            assert _all_recordable([a, b], extra, per_step), (a, b, per_step)
            assert not any(_all_recordable([a, b], e, per_step) for e in range(extra)), (
                a,
                b,
                per_step,
            )


def test_sample_rate_one_never_allows_capture() -> None:
    with pytest.raises(ValueError, match="sample rate 1"):
        steps_until_capturable([0], 1, sample_rate=1)
    with pytest.raises(ValueError):
        default_warmup_steps(0, sample_rate=1)


def test_default_warmup_of_a_fresh_model_is_11() -> None:
    assert default_warmup_steps(0) == 11


@pytest.mark.parametrize(
    ("forwards_before", "steps"),
    [
        (0, 11),
        (9, 2),  # warm-up 10, 11; capture 12
        (10, 1),
        (11, 1),
        (89, 1),  # warm-up 90; capture 91: neither 90 nor 91 is sampled
        (98, 3),  # warm-up 99, 100, 101; capture 102
        (99, 2),  # warm-up 100, 101; capture 102
        (100, 1),  # warm-up 101; capture 102
        (198, 3),
    ],
)
def test_default_warmup_steps(forwards_before: int, steps: int) -> None:
    """`default_warmup_steps(n)` eager steps, then the capture records forward
    n + steps + 1, which must be recordable; at least one warm-up step (the probe)."""
    assert default_warmup_steps(forwards_before) == steps


def test_default_warmup_steps_is_the_fewest_that_reach_a_recordable_forward() -> None:
    for n in range(0, 320):
        steps = default_warmup_steps(n)
        assert steps >= 1
        assert _recordable(n + steps + 1), (
            f"{n} forwards, {steps} warm-up: capture on {n + steps + 1}"
        )
        assert not any(_recordable(n + w + 1) for w in range(1, steps)), n
