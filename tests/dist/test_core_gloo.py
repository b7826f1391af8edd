"""`capture_step` across processes: torchrun + gloo on CPU, with the stand-in backend.

Every scenario of tests/scenarios/cpu_core.py runs in one torchrun launch per
configuration (2 processes, 4 processes, and a 2-node job on localhost that goes
through torchrun's c10d rendezvous as separate hosts would); the tests assert on the
JSON each rank wrote. What they check is that all ranks take the same path on the same
call, that nothing hangs, and that training equals the eager loop bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest

from launcher import ok, run_scenarios, run_scenarios_multinode

pytestmark = pytest.mark.multiprocess

SCRIPT = "cpu_core.py"
SCENARIOS = [
    "equivalence",
    "fail_one_rank",
    "fail_one_rank_raise",
    "schedule_inside_on_one_rank",
    "refusal_on_one_rank",
    "input_change_on_one_rank",
    "no_backend_on_cpu",
]
MULTINODE_SCENARIOS = ["equivalence", "fail_one_rank"]
Results = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module", params=[2, 4], ids=["2proc", "4proc"])
def nproc(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture(scope="module")
def results(nproc: int, tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = tmp_path_factory.mktemp(f"gloo{nproc}")
    return run_scenarios(SCRIPT, SCENARIOS, out, nproc=nproc, timeout=240)


@pytest.fixture(scope="module")
def multinode(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = tmp_path_factory.mktemp("two_nodes")
    return run_scenarios_multinode(
        SCRIPT, MULTINODE_SCENARIOS, out, nnodes=2, nproc_per_node=1, timeout=240
    )


def _ranks(results: Results, name: str) -> list[dict[str, Any]]:
    ranks = ok(results[name])
    world = ranks[0]["world_size"]
    assert [r["rank"] for r in ranks] == list(range(world))
    assert all(r["world_size"] == world for r in ranks)
    return ranks


def _check_equivalence(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0, r
        assert r["state"] == "closed"  # closed after training captured
        assert r["code"] is None
        assert r["states"] == ["warmup"] * 11 + ["captured"] * 19
        stats = r["stats"]
        assert (stats["captures"], stats["replays"], stats["eager_steps"]) == (1, 19, 0)


def _check_fail_one_rank(ranks: list[dict[str, Any]]) -> None:
    world = len(ranks)
    for r in ranks:
        assert r["state"] == "eager", r
        assert r["code"] == "CAPTURE_FAILED"
        assert r["ranks"] == [world - 1]
        assert "injected" in r["reason"]
        assert f"only on rank {world - 1}" in r["reason"]
        assert r["states"] == ["warmup"] * 11 + ["eager"] * 9  # every rank on the same call
        assert r["stats"]["captures"] == 0
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0


def test_world_size_comes_from_torchrun(results: Results, nproc: int) -> None:
    for name in SCENARIOS:
        assert len(_ranks(results, name)) == nproc


def test_equivalence(results: Results) -> None:
    _check_equivalence(_ranks(results, "equivalence"))


def test_fail_one_rank(results: Results) -> None:
    _check_fail_one_rank(_ranks(results, "fail_one_rank"))


def test_fail_one_rank_raise(results: Results) -> None:
    ranks = _ranks(results, "fail_one_rank_raise")
    world = len(ranks)
    for r in ranks:
        assert r["raised_at"] == 11, r  # the capture call, on every rank
        assert r["code"] == "CAPTURE_FAILED"
        assert r["ranks"] == [world - 1]
        assert r["unchanged"] is True


def test_schedule_inside_on_one_rank(results: Results) -> None:
    ranks = _ranks(results, "schedule_inside_on_one_rank")
    world = len(ranks)
    for r in ranks:
        assert r["state"] == "eager", r
        assert r["code"] == "LR_BAKED_INTO_GRAPH"
        assert r["ranks"] == [world - 1]
        assert r["stats"]["captures"] == 0 and r["stats"]["warmup_steps"] == 11


def test_refusal_on_one_rank(results: Results) -> None:
    ranks = _ranks(results, "refusal_on_one_rank")
    world = len(ranks)
    for r in ranks:
        assert r["state"] == "eager", r
        assert r["code"] == "OPTIMIZER_NOT_CAPTURABLE"
        assert r["ranks"] == [world - 1]
        assert "Adagrad" in r["reason"]
        assert r["stats"]["warmup_steps"] == 0 and r["stats"]["eager_steps"] == 3


def test_input_change_on_one_rank(results: Results) -> None:
    ranks = _ranks(results, "input_change_on_one_rank")
    last = len(ranks) - 1
    for r in ranks:
        changed = r["rank"] == last
        assert r["state"] == "captured", r
        assert r["stats"]["input_changes"] == (1 if changed else 0)
        assert r["stats"]["eager_steps"] == (1 if changed else 0)
        assert r["stats"]["replays"] == (8 if changed else 9)
        assert len(r["warnings"]) == (1 if changed else 0)
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0
    [warning] = ranks[last]["warnings"]
    assert "INPUT_SIGNATURE_CHANGED" in warning and "(5, 16)" in warning


def test_no_backend_on_cpu(results: Results) -> None:
    ranks = _ranks(results, "no_backend_on_cpu")
    for r in ranks:
        assert r["state"] == "eager", r
        assert r["code"] == "NO_CUDA"
        assert r["ranks"] == list(range(len(ranks)))
        assert r["stats"]["eager_steps"] == 3


def test_two_nodes_world_size(multinode: Results) -> None:
    for name in MULTINODE_SCENARIOS:
        ranks = _ranks(multinode, name)
        assert len(ranks) == 2
        assert all(r["world_size"] == 2 for r in ranks)


def test_two_nodes_equivalence(multinode: Results) -> None:
    _check_equivalence(_ranks(multinode, "equivalence"))


def test_two_nodes_fail_one_rank(multinode: Results) -> None:
    _check_fail_one_rank(_ranks(multinode, "fail_one_rank"))
