"""Frozen Python values with CUDA graphs: the CPU suite's scenarios
(tests/dist/test_frozen_gloo.py) on GPUs, one process per GPU, and `compile=True`.

On CUDA the captured step and the eager reference run the same kernels (graph-safe
AdamW), so the comparisons allow the project's 1e-5 relative.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from launcher import gpu_world, ok, run_scenarios, scenarios_for_world

pytestmark = pytest.mark.gpu
TOL = 1e-5
REFUSED = {"counter": "counter", "ramp": "ramp", "weight_from_global": "global"}
CLEAN = [
    "clean_demo_gpt",
    "clean_hf_gpt2",
    "clean_hf_llama",
    "clean_cnn_sgd",
    "clean_accumulate_scaler",
]
ALL_NAMES = [
    *REFUSED,
    "flag_after_capture",
    "flag_after_capture_unchecked",
    "flag_on_one_rank",
    "counter_after_capture",
    *CLEAN,
    "compile_guard_after_capture",
    "compile_setting_after_capture",
    "compile_counter",
]
TWO_RANKS = {"flag_on_one_rank"}
NAMES = scenarios_for_world(ALL_NAMES, TWO_RANKS)
Results = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = tmp_path_factory.mktemp("gpu_frozen")
    return run_scenarios("gpu_frozen.py", NAMES, Path(out), nproc=gpu_world(), timeout=540)


@pytest.mark.parametrize("name", list(REFUSED))
def test_value_changing_in_warmup_is_refused_at_the_probe(results: Results, name: str) -> None:
    for r in ok(results[name]):
        assert r["code"] == "FROZEN_PYTHON_VALUE" and r["state"] == "eager", r["reason"]
        assert r["line"][1].endswith(f"# frozen: {REFUSED[name]}")
        assert r["states"] == ["warmup"] * 10 + ["eager"] * 20
        assert r["count"] == r["eager_count"]
        assert r["loss_rel_diff"] <= TOL and r["param_rel_diff"] <= TOL


def test_flag_flipped_after_capture_is_caught_by_the_check(results: Results) -> None:
    for r in ok(results["flag_after_capture"]):
        assert r["state"] == "captured" and r["findings"] == ["FROZEN_PYTHON_VALUE"], r["reason"]
        assert r["finding_lines"][0].endswith("# frozen: flag")
        assert r["states"] == ["warmup"] * 11 + ["captured"] * 9 + ["warmup"] + ["captured"] * 9
        assert r["stats"]["captures"] == 2
        assert r["loss_rel_diff"] <= TOL and r["param_rel_diff"] <= TOL


def test_flag_flipped_after_capture_unchecked_stays_frozen(results: Results) -> None:
    for r in ok(results["flag_after_capture_unchecked"]):
        assert r["state"] == "captured" and r["findings"] == []
        assert r["param_rel_diff"] > 1e-2


@pytest.mark.two_ranks
def test_flag_on_one_rank_recaptures_every_rank(results: Results) -> None:
    ranks = ok(results["flag_on_one_rank"])
    for r in ranks:
        assert r["findings"] == ["FROZEN_PYTHON_VALUE"] and r["stats"]["captures"] == 2
        assert r["states"] == ranks[0]["states"]
        assert r["param_rel_diff"] <= TOL


def test_value_changing_after_capture_ends_eager(results: Results) -> None:
    for r in ok(results["counter_after_capture"]):
        assert r["code"] == "FROZEN_PYTHON_VALUE" and r["state"] == "eager", r["reason"]
        assert r["line"][1].endswith("# frozen: decay") and r["stats"]["captures"] == 1


@pytest.mark.parametrize("name", CLEAN)
def test_correct_steps_stay_captured(results: Results, name: str) -> None:
    for r in ok(results[name]):
        assert r["state"] == "captured" and r["code"] is None, r["reason"]
        assert r["findings"] == [] and r["warnings"] == []
        assert r["stats"]["captures"] == 1 and r["stats"]["value_checks"] >= 2
        if "param_rel_diff" in r:
            assert r["param_rel_diff"] <= TOL


def test_compile_a_guard_failing_at_a_check_captures_again(results: Results) -> None:
    for r in ok(results["compile_guard_after_capture"]):
        assert r["state"] == "captured" and r["code"] is None, r["reason"]
        assert r["captures"] == 2, r["states"]
        assert len(r["warnings"]) == (1 if r["rank"] == 0 else 0)
        if r["rank"] == 0:
            # Dynamo's guard on the attribute (`self.gated`), at the line it guards.
            assert "gated" in r["warnings"][0] and "# frozen: guarded" in r["warnings"][0], r[
                "warnings"
            ]


def test_compile_a_setting_changed_after_capture_is_captured_again_at_a_check(
    results: Results,
) -> None:
    for r in ok(results["compile_setting_after_capture"]):
        assert r["state"] == "captured" and r["code"] is None, r["reason"]
        # Eager from call 30 (where Dynamo recompiles for it), captured again at the check.
        assert r["captures"] == 2 and "warmup" in r["states"][30:], r["states"]
        assert r["warnings"] == []
        assert len(r["setting_warnings"]) == (1 if r["rank"] == 0 else 0)
        if r["rank"] == 0:
            assert "`module.gain`" in r["setting_warnings"][0], r["setting_warnings"]


def test_compile_a_counter_in_the_step_is_refused(results: Results) -> None:
    for r in ok(results["compile_counter"]):
        assert r["code"] == "FROZEN_PYTHON_VALUE" and r["state"] == "eager", r["reason"]
        assert "# frozen: compiled counter" in r["reason"]
