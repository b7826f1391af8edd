"""`ddpgraph.integrations.lightning.CUDAGraphCallback` in a real Lightning `Trainer(strategy="ddp")`
on 2 gloo processes (tests/scenarios/lightning_train.py), with the stand-in backend.

Captured runs must equal the same runs without the callback bit for bit: per-step
losses, the values `self.log` recorded (per step and per epoch), the step outputs, the
learning rates the scheduler set, validation, and the final parameters.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("lightning")

from launcher import ok
from shared_launches import batched

pytestmark = pytest.mark.multiprocess
CAPTURED = ["equivalence", "clipping", "bf16"]
REFUSED = {"manual_optimization": "manual optimization", "accumulate": "accumulate_grad_batches=2"}
Results = dict[str, list[dict[str, Any]]]


# Run in one launch with the other modules' scenarios of the same world size (launcher.batched).
LAUNCH = batched(
    "lightning_train.py", [*CAPTURED, *REFUSED, "checkpoint_resume"], nproc=2, timeout=900
)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    return LAUNCH.results(tmp_path_factory)


@pytest.mark.parametrize("name", CAPTURED)
def test_the_whole_optimizer_step_is_captured_and_trains_like_lightning(
    results: Results, name: str
) -> None:
    for r in ok(results[name]):
        assert r["state"] == "captured" and r["code"] is None, r["reason"]
        assert r["stats"]["warmup_steps"] == 11 and r["stats"]["captures"] == 1
        assert r["stats"]["replays"] == r["steps"] - 11 and r["stats"]["eager_steps"] == 0
        assert all(r["same"].values()), r["same"]
        assert r["param_rel_diff"] == 0.0
        assert r["restored"]  # the module's own optimizer_step is back


def test_the_schedule_and_validation_really_ran(results: Results) -> None:
    r = ok(results["equivalence"])[0]
    assert len(set(r["lrs"])) == r["steps"]  # a new learning rate every step, after capture too
    assert len(r["val"]) == 3  # sanity check, then after each of the 2 epochs


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_cannot_be_captured_is_refused_once_and_trains_eagerly(
    results: Results, name: str
) -> None:
    for r in ok(results[name]):
        assert r["state"] == "eager" and r["code"] == "UNSUPPORTED_SETUP"
        assert REFUSED[name] in r["reason"] and "[ranks 0-1]" in r["reason"]
        assert all(r["same"].values()) and r["param_rel_diff"] == 0.0


def test_a_checkpoint_resumes_and_captures_again(results: Results) -> None:
    for r in ok(results["checkpoint_resume"]):
        assert r["state"] == "captured" and r["stats"]["captures"] == 1, r
        assert r["steps"] == 16  # the second epoch only
        assert r["same_losses"] and r["param_rel_diff"] == 0.0
