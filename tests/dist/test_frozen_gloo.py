"""Frozen Python values across processes: torchrun + gloo on CPU.

The scenarios of tests/scenarios/cpu_frozen.py run under the recording backend, whose
replays run no Python as a CUDA graph's do (the stand-in's replays run the step again
and would hide every frozen value), at 2 and 4 processes; the steps that must stay
captured run under both backends at 2.
"""

from __future__ import annotations

from typing import Any

import pytest

from launcher import ok
from shared_launches import batched
from variants import VARIANTS, both_backends, key

pytestmark = pytest.mark.multiprocess

SCRIPT = "cpu_frozen.py"
REFUSED = {"counter": "counter", "ramp": "ramp", "weight_from_global": "global"}
RECORDED = [
    *REFUSED,
    "flag_after_capture",
    "flag_after_capture_unchecked",
    "global_flag_after_capture",
    "config_after_capture",
    "flag_on_one_rank",
    "counter_after_capture",
    "history",
    "running_average",
]
CLEAN = [
    "clean_demo_gpt",
    "clean_hf_gpt2",
    "clean_hf_llama",
    "clean_cnn_sgd",
    "clean_accumulate_scaler",
]
AT_4 = [
    "counter",
    "flag_on_one_rank",
    "counter_after_capture",
    "history",
    "running_average",
    "clean_cnn_sgd",
]
Results = dict[str, list[dict[str, Any]]]
# Run in one launch with the other modules' scenarios of the same world size (launcher.batched).
LAUNCHES = (
    {
        2: batched(SCRIPT, both_backends(CLEAN, RECORDED), nproc=2, timeout=400),
        4: batched(SCRIPT, [f"recording:{n}" for n in AT_4], nproc=4, timeout=400),
    }
    if "recording" in VARIANTS
    else {}
)


@pytest.fixture(scope="module", params=[2, 4], ids=["2proc", "4proc"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Results:
    nproc = int(request.param)
    if "recording" not in VARIANTS:
        pytest.skip("frozen values show only with the recording backend")
    return LAUNCHES[nproc].results(tmp_path_factory)


def _ranks(results: Results, name: str, variant: str = "recording") -> list[dict[str, Any]]:
    if key(name, variant) not in results:
        pytest.skip(f"{name} runs with the {variant} backend at 2 ranks only")
    ranks = ok(results[key(name, variant)])
    assert [r["rank"] for r in ranks] == list(range(ranks[0]["world_size"]))
    return ranks


def _warned_once(ranks: list[dict[str, Any]]) -> None:
    """Every rank decides together, and rank 0 alone says so."""
    assert len(ranks[0]["warnings"]) == 1, ranks[0]["warnings"]
    assert all(not r["warnings"] for r in ranks[1:])


@pytest.mark.parametrize("name", list(REFUSED))
def test_value_changing_in_warmup_is_refused_at_the_probe(results: Results, name: str) -> None:
    ranks = _ranks(results, name)
    for r in ranks:
        assert r["code"] == "FROZEN_PYTHON_VALUE", r["reason"]
        assert r["state"] == "eager" and r["ranks"] == list(range(len(ranks)))
        assert r["line"][1].endswith(f"# frozen: {REFUSED[name]}")  # the user's line
        assert (
            r["states"] == ["warmup"] * 10 + ["eager"] * 20
        )  # every rank, from the probe step (the 11th) on
        assert r["stats"]["captures"] == 0
        # Nothing was lost: the step's Python ran on every call, as in eager training.
        assert r["count"] == r["eager_count"]
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0
        assert "in the last 3 warm-up steps" in r["reason"]
    _warned_once(ranks)


def test_state_changed_outside_the_step_is_refused_at_its_line(results: Results) -> None:
    """A count the step keeps and never passes to torch: replays would stop it counting."""
    ranks = _ranks(results, "history")
    for r in ranks:
        assert r["code"] == "FROZEN_PYTHON_VALUE" and r["state"] == "eager", r["reason"]
        assert r["ranks"] == list(range(len(ranks)))
        assert "the step changes `state['count']`" in r["reason"]
        assert r["line"][1].endswith("# frozen: history")  # in the helper the step calls
        assert r["states"] == ["warmup"] * 10 + ["eager"] * 20 and r["stats"]["captures"] == 0
        assert r["count"] == r["eager_count"] == 30
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0
    _warned_once(ranks)


def test_a_tensor_rebound_from_itself_is_refused_at_its_line(results: Results) -> None:
    """A running average kept as `avg = avg * 0.9 + loss`: replays would read the
    captured tensor on every call."""
    ranks = _ranks(results, "running_average")
    for r in ranks:
        assert r["code"] == "FROZEN_PYTHON_VALUE" and r["state"] == "eager", r["reason"]
        assert r["ranks"] == list(range(len(ranks)))
        assert (
            "the step replaces `state['average']`, a tensor outside it that it reads" in r["reason"]
        )
        assert r["line"][1].endswith("# frozen: average")
        assert r["states"] == ["warmup"] * 10 + ["eager"] * 20 and r["stats"]["captures"] == 0
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0
    _warned_once(ranks)


def test_counter_names_its_values(results: Results) -> None:
    r = _ranks(results, "counter")[0]
    assert r["count"] == 30  # it stopped at 12 when the graph froze it
    assert "0.111111, 0.1, 0.0909091" in r["reason"]  # 1/9, 1/10, 1/11


def test_flag_flipped_after_capture_is_caught_by_the_check(results: Results) -> None:
    for r in _ranks(results, "flag_after_capture"):
        assert r["state"] == "captured" and r["code"] is None  # captured again, with the flag
        assert r["findings"] == ["FROZEN_PYTHON_VALUE"]
        assert r["finding_lines"][0].endswith("# frozen: flag")
        # Check calls 14, 16, 18, 20; the flag flips before call 20, which is served
        # eagerly, so no replay ran with the stale flag: training equals eager bit for bit.
        assert r["states"] == ["warmup"] * 11 + ["captured"] * 9 + ["warmup"] + ["captured"] * 9
        assert r["stats"]["captures"] == 2
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0


def test_flag_flipped_after_capture_unchecked_stays_frozen(results: Results) -> None:
    """Without `verify_every`: what the check is for. The graph keeps the flag it
    recorded, without a finding, and training drifts from eager."""
    for r in _ranks(results, "flag_after_capture_unchecked"):
        assert r["state"] == "captured" and r["findings"] == []
        assert r["param_rel_diff"] > 1e-2


@pytest.mark.parametrize(
    "name, path, was, mark",
    [
        ("global_flag_after_capture", "AUX_ON", "False", "global flag"),
        ("config_after_capture", "CFG.aux_weight", "0.0", "config"),
    ],
)
def test_a_value_the_step_reads_set_after_capture_runs_eagerly(
    results: Results, name: str, path: str, was: str, mark: str
) -> None:
    """Without checks: the step reads a module-level flag, or an attribute of the
    script's config object, that the loop sets on every rank on the 20th call; it
    differs from the recorded value, so each call from then on runs eagerly on every
    rank, and training follows it."""
    for r in _ranks(results, name):
        assert r["state"] == "captured" and r["findings"] == [], r["reason"]
        assert r["stats"]["eager_steps"] == 30 - 20 + 1 and r["stats"]["captures"] == 1
        [warning] = r["warnings"]
        assert f"the step reads `{path}`, which was {was} when the graph was recorded" in warning
        assert f"# frozen: {mark}" in warning
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0


def test_flag_on_one_rank_recaptures_every_rank(results: Results) -> None:
    ranks = _ranks(results, "flag_on_one_rank")
    last = len(ranks) - 1
    for r in ranks:
        assert r["findings"] == ["FROZEN_PYTHON_VALUE"]
        assert r["stats"]["captures"] == 2  # every rank captured again, on the same call
        assert r["states"] == ranks[0]["states"]
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0
    _warned_once(ranks)
    assert f"[rank {last}]" in ranks[0]["warnings"][0]


def test_value_changing_after_capture_ends_eager(results: Results) -> None:
    ranks = _ranks(results, "counter_after_capture")
    for r in ranks:
        # The check at call 22 sees the decay change, the new warm-up's probe sees it change again.
        assert r["code"] == "FROZEN_PYTHON_VALUE" and r["state"] == "eager"
        assert r["line"][1].endswith("# frozen: decay")
        assert "a check call and this warm-up step" in r["reason"]
        assert r["stats"]["captures"] == 1
        assert r["states"][22:] == ["eager"] * 8


@pytest.mark.parametrize("name", CLEAN)
def test_correct_steps_stay_captured(results: Results, name: str, variant: str) -> None:
    for r in _ranks(results, name, variant):
        assert r["state"] == "captured" and r["code"] is None, r["reason"]
        assert r["findings"] == [] and r["warnings"] == []
        assert r["stats"]["captures"] == 1
        assert r["stats"]["value_checks"] >= 2  # checked after capture, and found nothing
        if "param_rel_diff" in r:  # check calls are eager steps: training equals eager
            assert r["param_rel_diff"] == 0.0
