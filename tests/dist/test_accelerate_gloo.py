"""`ddpgraph.capture_step` on Hugging Face Accelerate's prepared model, optimizer, data
loader and scheduler, on 2 gloo processes with the stand-in backend
(tests/scenarios/accelerate_train.py): captured runs equal the same runs eagerly with
the same graph-safe optimizer, bit for bit; gradient accumulation is refused with a code."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("accelerate")

from launcher import ok
from shared_launches import batched

pytestmark = pytest.mark.multiprocess
CAPTURED = ["fp32", "bf16", "clipping"]
Results = dict[str, list[dict[str, Any]]]


# Run in one launch with the other modules' scenarios of the same world size (launcher.batched).
LAUNCH = batched("accelerate_train.py", [*CAPTURED, "accumulate"], nproc=2, timeout=600)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    return LAUNCH.results(tmp_path_factory)


@pytest.mark.parametrize("name", CAPTURED)
def test_prepared_objects_are_captured_and_train_like_eager(results: Results, name: str) -> None:
    for r in ok(results[name]):
        assert r["state"] == "captured" and r["code"] is None, r["reason"]
        assert r["stats"]["replays"] == r["steps"] - 11 and r["stats"]["eager_steps"] == 0
        assert r["same_losses"] and r["same_lrs"] and r["param_rel_diff"] == 0.0, r
        assert len(set(r["lrs"])) == r["steps"]  # the wrapped scheduler kept scheduling


def test_gradient_accumulation_is_refused_and_trains_eagerly(results: Results) -> None:
    for r in ok(results["accumulate"]):
        assert r["state"] == "eager" and r["code"] == "UNSUPPORTED_SETUP"
        assert "gradient_accumulation_steps=2" in r["reason"] and "[ranks 0-1]" in r["reason"]
        assert r["same_losses"] and r["param_rel_diff"] == 0.0
