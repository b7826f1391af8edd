"""An event on one rank only never hangs the job nor splits the ranks' paths.

Each scenario of tests/scenarios/cpu_rank_safety.py makes something happen on the last
rank only; the tests check that every rank ends in the same state, took each transition
on the same call, and trained exactly as eager training with the same events, with the
stand-in backend and with the recording backend (whose replays run no Python and replay
the recorded collectives). The rank that saw an event says so in its state from that
call on (`eager` until the ranks decide). The process group's timeout is 30 s: a rank
left alone in a collective fails its scenario instead of passing late.
"""

from __future__ import annotations

from typing import Any

import pytest

from launcher import ok
from shared_launches import batched
from variants import both_backends, key

pytestmark = pytest.mark.multiprocess

SCRIPT = "cpu_rank_safety.py"
SCENARIOS = [
    "plain_module_on_one_rank",
    "optimizer_load_on_one_rank",
    "input_raise_on_one_rank",
    "usage_error_on_one_rank",
    "warmup_differs_by_rank",
    "hyperparameter_raise_on_one_rank",
    "hyperparameter_eager_on_one_rank",
    "state_cleared_on_one_rank",
    "non_optimizer_on_one_rank",
    "unsupported_argument_on_one_rank",
    "step_raises_in_capture_on_one_rank",
]
# A collective that waits for a stopped rank: the recording backend's replay waits on the
# host, as a CUDA replay's does not (the watchdog's REPLAY_TIMED_OUT is for that).
RECORDING_ONLY = ["stops_calling_on_one_rank", "skips_a_call_on_one_rank"]
EVENT_CALL = 14  # the scenarios' event on the last rank comes before this call (0-based)
Results = dict[str, list[dict[str, Any]]]


# Run in one launch with the other modules' scenarios of the same world size (launcher.batched).
LAUNCHES = {
    n: batched(SCRIPT, both_backends(SCENARIOS, RECORDING_ONLY), nproc=n, timeout=400)
    for n in (2, 4)
}


@pytest.fixture(scope="module", params=[2, 4], ids=["2proc", "4proc"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Results:
    return LAUNCHES[int(request.param)].results(tmp_path_factory)


def _ranks(results: Results, name: str, variant: str) -> list[dict[str, Any]]:
    ranks = ok(results[key(name, variant)])
    assert [r["rank"] for r in ranks] == list(range(ranks[0]["world_size"]))
    return ranks


def _same_on_every_rank(ranks: list[dict[str, Any]], *keys: str) -> None:
    for name in keys:
        assert len({repr(r.get(name)) for r in ranks}) == 1, (name, [r.get(name) for r in ranks])


def _equal_to_eager(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0, r


def _decided_together(ranks: list[dict[str, Any]], code: str) -> None:
    """Every rank took each transition on the same call; the last rank, which saw the
    event on call EVENT_CALL, said `eager` and why from that call until the decision."""
    first = ranks[0]["states"]
    assert all(r["states"] == first for r in ranks[:-1]), [r["states"] for r in ranks]
    decided = next(i for i in range(EVENT_CALL, len(first)) if first[i] != "captured")
    assert decided > EVENT_CALL, first
    last = ranks[-1]
    assert last["states"][:EVENT_CALL] == first[:EVENT_CALL]
    assert last["states"][EVENT_CALL:decided] == ["eager"] * (decided - EVENT_CALL), last["states"]
    assert set(last["codes"][EVENT_CALL:decided]) == {code}, last["codes"]
    assert last["states"][decided:] == first[decided:]


def test_plain_module_step_on_one_rank_decides_alone(results: Results, variant: str) -> None:
    ranks = _ranks(results, "plain_module_on_one_rank", variant)
    assert ranks[0]["built"] and ranks[0]["state"] == "captured"
    assert ranks[0]["loss_rel_diff"] == 0.0
    assert not any(r["built"] for r in ranks[1:])


def test_optimizer_load_on_one_rank_recaptures_on_every_rank(
    results: Results, variant: str
) -> None:
    ranks = _ranks(results, "optimizer_load_on_one_rank", variant)
    _same_on_every_rank(ranks, "state")
    _decided_together(ranks, "OPTIMIZER_STATE_REPLACED")
    _equal_to_eager(ranks)
    for r in ranks:
        assert r["state"] == "captured" and r["stats"]["captures"] == 2, r
    last = ranks[-1]["stats"]
    assert (
        last["eager_steps"] > ranks[0]["stats"]["eager_steps"]
    )  # ran eagerly until the ranks agreed


def test_input_change_raise_on_one_rank_raises_on_every_rank(
    results: Results, variant: str
) -> None:
    ranks = _ranks(results, "input_raise_on_one_rank", variant)
    _same_on_every_rank(ranks, "raised_at", "raised_code", "raised_ranks", "state")
    assert ranks[0]["raised_code"] == "INPUT_SIGNATURE_CHANGED"
    assert ranks[0]["raised_ranks"] == [len(ranks) - 1]
    assert 14 < ranks[0]["raised_at"] < 40
    _equal_to_eager(ranks)


def test_usage_error_on_one_rank_raises_on_every_rank(results: Results, variant: str) -> None:
    ranks = _ranks(results, "usage_error_on_one_rank", variant)
    _same_on_every_rank(ranks, "raised", "code", "ranks")
    assert ranks[0]["raised"] and ranks[0]["code"] == "WARMUP_TOO_SHORT"
    assert all(r["lr_is_float"] for r in ranks)  # nothing was changed before raising


def test_warmup_that_differs_by_rank_captures_on_one_call(results: Results, variant: str) -> None:
    ranks = _ranks(results, "warmup_differs_by_rank", variant)
    _same_on_every_rank(ranks, "states")
    assert ranks[0]["states"].index("captured") == 11 + len(ranks) - 1
    _equal_to_eager(ranks)


def test_hyperparameter_guard_raise_on_one_rank_raises_on_every_rank(
    results: Results, variant: str
) -> None:
    ranks = _ranks(results, "hyperparameter_raise_on_one_rank", variant)
    _same_on_every_rank(ranks, "raised_at", "raised_code", "state")
    assert ranks[0]["raised_code"] == "LR_BAKED_INTO_GRAPH" and 14 < ranks[0]["raised_at"] < 40
    _equal_to_eager(ranks)


def test_hyperparameter_guard_on_one_rank_falls_back_on_every_rank(
    results: Results, variant: str
) -> None:
    ranks = _ranks(results, "hyperparameter_eager_on_one_rank", variant)
    _same_on_every_rank(ranks, "state", "code")
    _decided_together(ranks, "LR_BAKED_INTO_GRAPH")
    assert ranks[0]["state"] == "eager" and ranks[0]["code"] == "LR_BAKED_INTO_GRAPH"
    _equal_to_eager(ranks)


def test_state_cleared_on_one_rank_recaptures_on_every_rank(results: Results, variant: str) -> None:
    ranks = _ranks(results, "state_cleared_on_one_rank", variant)
    _same_on_every_rank(ranks, "state")
    _decided_together(ranks, "OPTIMIZER_STATE_REPLACED")
    for r in ranks:
        assert r["state"] == "captured" and r["stats"]["captures"] == 2, r
    _equal_to_eager(ranks)


def test_non_optimizer_on_one_rank_raises_on_every_rank(results: Results, variant: str) -> None:
    ranks = _ranks(results, "non_optimizer_on_one_rank", variant)
    _same_on_every_rank(ranks, "raised", "code", "ranks")
    assert ranks[0]["raised"] and ranks[0]["code"] == "INVALID_ARGUMENT"
    assert ranks[0]["ranks"] == [len(ranks) - 1] and "got str" in ranks[0]["text"]


def test_unsupported_argument_on_one_rank_raises_on_every_rank_at_the_first_call(
    results: Results, variant: str
) -> None:
    ranks = _ranks(results, "unsupported_argument_on_one_rank", variant)
    _same_on_every_rank(ranks, "raised", "code", "ranks", "calls")
    assert ranks[0]["raised"] and ranks[0]["code"] == "UNSUPPORTED_INPUT"
    assert ranks[0]["ranks"] == [len(ranks) - 1] and ranks[0]["calls"] == 1


def test_step_raising_in_the_capture_call_on_one_rank_raises_on_every_rank(
    results: Results, variant: str
) -> None:
    ranks = _ranks(results, "step_raises_in_capture_on_one_rank", variant)
    _same_on_every_rank(ranks, "states", "state")
    last = ranks[-1]
    assert [r["retried"][0]["at"] for r in ranks] == [11] * len(ranks)
    assert last["retried"][0]["own"] and "bad batch" in last["retried"][0]["text"]
    for r in ranks[:-1]:
        text = r["retried"][0]["text"]
        assert not r["retried"][0]["own"] and text.startswith("[RANK_STOPPED]"), text
        assert "StepFailed: bad batch" in text and f"rank {len(ranks) - 1}" in text, text
    for r in ranks:  # the retried call captured
        assert r["state"] == "captured" and r["stats"]["captures"] == 1, r
    _equal_to_eager(ranks)


@pytest.mark.parametrize(
    "name, calls", [("stops_calling_on_one_rank", 20), ("skips_a_call_on_one_rank", 29)]
)
def test_a_rank_that_stops_calling_is_named_by_its_peers(
    results: Results, name: str, calls: int
) -> None:
    ranks = _ranks(results, name, "recording")
    last = len(ranks) - 1
    assert ranks[last]["raised"] is None and ranks[last]["calls"] == calls
    for r in ranks[:-1]:
        raised = r["raised"]
        assert raised is not None and raised["code"] == "RANK_STOPPED", r
        assert f"on call {calls + 1} of the step" in raised["text"], raised
        assert f"rank {last} made {calls} calls" in raised["text"], raised
