"""An event on one rank only never hangs the job nor splits the ranks' paths.

Each scenario of tests/scenarios/cpu_rank_safety.py makes something happen on the last
rank only; the tests check that every rank ends in the same state, took each transition
on the same call, and trained exactly as eager training with the same events. The
process group's timeout is 30 s: a rank left alone in a collective fails its scenario
instead of passing late.
"""

from __future__ import annotations

from typing import Any

import pytest

from launcher import ok, run_scenarios

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
]
Results = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module", params=[2, 4], ids=["2proc", "4proc"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Results:
    nproc = int(request.param)
    out = tmp_path_factory.mktemp(f"rank_safety{nproc}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DDPGRAPH_TEST_PG_TIMEOUT", "30")
        return run_scenarios(SCRIPT, SCENARIOS, out, nproc=nproc, timeout=400)


def _ranks(results: Results, name: str) -> list[dict[str, Any]]:
    ranks = ok(results[name])
    assert [r["rank"] for r in ranks] == list(range(ranks[0]["world_size"]))
    return ranks


def _same_on_every_rank(ranks: list[dict[str, Any]], *keys: str) -> None:
    for key in keys:
        assert len({repr(r.get(key)) for r in ranks}) == 1, (key, [r.get(key) for r in ranks])


def _equal_to_eager(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0, r


def test_plain_module_step_on_one_rank_decides_alone(results: Results) -> None:
    ranks = _ranks(results, "plain_module_on_one_rank")
    assert ranks[0]["built"] and ranks[0]["state"] == "captured"
    assert ranks[0]["loss_rel_diff"] == 0.0
    assert not any(r["built"] for r in ranks[1:])


def test_optimizer_load_on_one_rank_recaptures_on_every_rank(results: Results) -> None:
    ranks = _ranks(results, "optimizer_load_on_one_rank")
    _same_on_every_rank(ranks, "states", "state")
    _equal_to_eager(ranks)
    for r in ranks:
        assert r["state"] == "captured" and r["stats"]["captures"] == 2, r
    last = ranks[-1]["stats"]
    assert last["eager_steps"] > ranks[0]["stats"]["eager_steps"]  # ran eagerly until the ranks agreed


def test_input_change_raise_on_one_rank_raises_on_every_rank(results: Results) -> None:
    ranks = _ranks(results, "input_raise_on_one_rank")
    _same_on_every_rank(ranks, "raised_at", "raised_code", "raised_ranks", "state")
    assert ranks[0]["raised_code"] == "INPUT_SIGNATURE_CHANGED"
    assert ranks[0]["raised_ranks"] == [len(ranks) - 1]
    assert 14 < ranks[0]["raised_at"] < 40
    _equal_to_eager(ranks)


def test_usage_error_on_one_rank_raises_on_every_rank(results: Results) -> None:
    ranks = _ranks(results, "usage_error_on_one_rank")
    _same_on_every_rank(ranks, "raised", "code", "ranks")
    assert ranks[0]["raised"] and ranks[0]["code"] == "WARMUP_TOO_SHORT"
    assert all(r["lr_is_float"] for r in ranks)  # nothing was changed before raising


def test_warmup_that_differs_by_rank_captures_on_one_call(results: Results) -> None:
    ranks = _ranks(results, "warmup_differs_by_rank")
    _same_on_every_rank(ranks, "states")
    assert ranks[0]["states"].index("captured") == 11 + len(ranks) - 1
    _equal_to_eager(ranks)


def test_hyperparameter_guard_raise_on_one_rank_raises_on_every_rank(results: Results) -> None:
    ranks = _ranks(results, "hyperparameter_raise_on_one_rank")
    _same_on_every_rank(ranks, "raised_at", "raised_code", "state")
    assert ranks[0]["raised_code"] == "LR_BAKED_INTO_GRAPH" and 14 < ranks[0]["raised_at"] < 40
    _equal_to_eager(ranks)


def test_hyperparameter_guard_on_one_rank_falls_back_on_every_rank(results: Results) -> None:
    ranks = _ranks(results, "hyperparameter_eager_on_one_rank")
    _same_on_every_rank(ranks, "states", "state", "code")
    assert ranks[0]["state"] == "eager" and ranks[0]["code"] == "LR_BAKED_INTO_GRAPH"
    _equal_to_eager(ranks)


def test_state_cleared_on_one_rank_recaptures_on_every_rank(results: Results) -> None:
    ranks = _ranks(results, "state_cleared_on_one_rank")
    _same_on_every_rank(ranks, "states", "state")
    for r in ranks:
        assert r["state"] == "captured" and r["stats"]["captures"] == 2, r
    _equal_to_eager(ranks)
