"""The capture engine's guards with CUDA graphs and NCCL (tests/scenarios/gpu_rank_safety.py).

Runs at any world size (`DDPGRAPH_GPU_WORLD=1` on one GPU); the event on one rank only
then happens on the only rank, and the check that ranks agree is trivially true.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from launcher import gpu_world, ok, run_scenarios

pytestmark = pytest.mark.gpu
TOL = 1e-5
NAMES = [
    "storage_moved_after_capture",
    "optimizer_load_on_one_rank",
    "sampled_iteration_at_capture",
    "input_written_by_step",
]
Results = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = tmp_path_factory.mktemp("gpu_rank_safety")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DDPGRAPH_TEST_PG_TIMEOUT", "60")
        return run_scenarios("gpu_rank_safety.py", NAMES, Path(out), nproc=gpu_world(), timeout=600)


def test_moved_parameter_storage_is_captured_again(results: Results) -> None:
    for r in ok(results["storage_moved_after_capture"]):
        assert r["state"] == "captured" and r["stats"]["captures"] == 2, r
        assert r["codes"] == ["PARAMETERS_CHANGED"]
        assert r["loss_rel_diff"] <= TOL and r["param_rel_diff"] <= TOL, r


def test_optimizer_load_on_one_rank_is_captured_again_on_every_rank(results: Results) -> None:
    ranks = ok(results["optimizer_load_on_one_rank"])
    assert len({r["stats"]["captures"] for r in ranks}) == 1
    for r in ranks:
        assert r["state"] == "captured" and r["stats"]["captures"] == 2, r
        assert r["loss_rel_diff"] <= TOL and r["param_rel_diff"] <= TOL, r


def test_capture_avoids_a_sampled_iteration_found_at_the_capture_call(results: Results) -> None:
    for r in ok(results["sampled_iteration_at_capture"]):
        assert r["state"] == "captured", r
        assert r["recorded"] and r["capturable"], r


def test_a_step_that_writes_into_its_argument_stays_eager(results: Results) -> None:
    for r in ok(results["input_written_by_step"]):
        assert r["state"] == "eager" and r["codes"] == ["INPUT_CHANGED_BY_STEP"], r
        assert r["count"] == 15.0
