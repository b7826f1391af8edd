"""`ddpgraph.capture_step` on Accelerate's prepared objects with CUDA graphs, one process
per GPU (world size 1 works): Accelerate's DDP is built on the default stream and adopted
(tests/scenarios/accelerate_train.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")

from launcher import gpu_world, ok, run_scenarios

pytestmark = pytest.mark.gpu
TOL = 1e-5  # the project's bound; expected bit for bit, printed below
CAPTURED = ["fp32", "bf16", "clipping"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("gpu_accelerate")
    names = [*CAPTURED, "accumulate"]
    return run_scenarios("accelerate_train.py", names, Path(out), nproc=gpu_world(), timeout=600)


@pytest.mark.parametrize("name", CAPTURED)
def test_accelerate_step_is_captured_and_trains_like_eager(
    results: dict[str, list[dict[str, Any]]], name: str
) -> None:
    for r in ok(results[name]):
        print(
            f"{name} rank {r['rank']}: same losses = {r['same_losses']}, "
            f"param diff = {r['param_rel_diff']}"
        )
        assert r["state"] == "captured" and r["code"] is None, r["reason"]
        # Accelerate wraps the model in DDP only with several processes; a plain module
        # warms up 3 steps, a DDP one 11.
        assert r["stats"]["warmup_steps"] in (3, 11)
        assert r["stats"]["replays"] == r["steps"] - r["stats"]["warmup_steps"]
        assert r["param_rel_diff"] <= TOL and r["loss_rel_diff"] <= TOL, r


def test_accelerate_accumulation_is_refused(results: dict[str, list[dict[str, Any]]]) -> None:
    for r in ok(results["accumulate"]):
        assert r["state"] == "eager" and r["code"] == "UNSUPPORTED_SETUP"
