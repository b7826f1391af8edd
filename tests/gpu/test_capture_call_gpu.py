"""What a CUDA-graph capture must not serve or swallow (tests/scenarios/gpu_capture_call.py):
accumulation across calls with `ddp.no_sync()` refused, and the step's own exception or a
Ctrl-C in the capture call raised as it is, with the training state as before the call.

Runs at any world size (`DDPGRAPH_GPU_WORLD=1` on one GPU): each check is per rank, and at
two ranks the ranks must also agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from launcher import gpu_world, ok, run_scenarios

pytestmark = pytest.mark.gpu
TOL = 1e-5
NAMES = [
    "no_sync_outside",
    "no_sync_argument",
    "no_sync_after_capture",
    "raises_in_capture",
    "interrupted_in_capture",
]
PROBE_CALL = 11
Results = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = tmp_path_factory.mktemp("gpu_capture_call")
    return run_scenarios(
        "gpu_capture_call.py", NAMES, Path(out), nproc=gpu_world(), timeout=400, group_timeout_s=60
    )


def _same_states(ranks: list[dict[str, Any]]) -> None:
    assert len({repr(r["states"]) for r in ranks}) == 1, [r["states"] for r in ranks]


@pytest.mark.parametrize("name", ["no_sync_outside", "no_sync_argument"])
def test_accumulation_across_calls_is_refused_and_trains_as_eager(
    results: Results, name: str
) -> None:
    ranks = ok(results[name])
    _same_states(ranks)
    for r in ranks:
        assert r["state"] == "eager" and r["code"] == "UNSUPPORTED_SETUP", r
        assert r["stats"]["captures"] == 0 and r["stats"]["replays"] == 0, r
        assert r["states"][PROBE_CALL - 1 :] == ["eager"] * (len(r["states"]) - PROBE_CALL + 1), r[
            "states"
        ]
        assert r["loss_rel_diff"] <= TOL and r["param_rel_diff"] <= TOL, r


def test_accumulation_after_capture_runs_eagerly_from_its_first_call(results: Results) -> None:
    ranks = ok(results["no_sync_after_capture"])
    _same_states(ranks)
    for r in ranks:
        assert r["state"] == "eager" and r["code"] == "UNSUPPORTED_SETUP", r
        assert r["stats"]["captures"] == 1 and r["stats"]["replays"] == 24 - PROBE_CALL, r
        assert set(r["states"][24:]) == {"eager"}, r["states"]
        assert r["loss_rel_diff"] <= TOL and r["param_rel_diff"] <= TOL, r


@pytest.mark.parametrize(
    "name, error",
    [("raises_in_capture", "ValueError"), ("interrupted_in_capture", "KeyboardInterrupt")],
)
def test_what_the_step_raises_while_recorded_reaches_the_loop(
    results: Results, name: str, error: str
) -> None:
    for r in ok(results[name]):
        assert r["raised"] == {
            "at": PROBE_CALL,
            "type": error,
            "state": "warmup",
            "untouched": True,
        }, r
        assert r["state"] == "captured" and r["stats"]["captures"] == 1, r  # the retry captured
        assert r["loss_rel_diff"] <= TOL and r["param_rel_diff"] <= TOL, r
