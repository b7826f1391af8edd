"""`ddpgraph.integrations.lightning.CUDAGraphCallback` with CUDA graphs: a Lightning
`Trainer(accelerator="gpu", strategy="ddp")`, one process per GPU (world size 1 works),
against the same run without the callback (tests/scenarios/lightning_train.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

from launcher import gpu_world, ok, run_scenarios

pytestmark = pytest.mark.gpu
TOL = 1e-5  # the project's bound; expected bit for bit, printed below
NAMES = ["equivalence", "clipping", "bf16", "checkpoint_resume"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("gpu_lightning")
    return run_scenarios("lightning_train.py", NAMES, Path(out), nproc=gpu_world(), timeout=900)


@pytest.mark.parametrize("name", ["equivalence", "clipping", "bf16"])
def test_lightning_step_is_captured_and_trains_like_lightning(
    results: dict[str, list[dict[str, Any]]], name: str
) -> None:
    for r in ok(results[name]):
        print(f"{name} rank {r['rank']}: same = {r['same']}, fit seconds = {r['fit_seconds']}")
        assert r["state"] == "captured" and r["code"] is None, r["reason"]
        assert r["stats"]["replays"] == r["steps"] - 11
        assert r["param_rel_diff"] <= TOL and r["loss_rel_diff"] <= TOL, r


def test_lightning_checkpoint_resumes_and_captures_again(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    for r in ok(results["checkpoint_resume"]):
        assert r["state"] == "captured", r
        assert r["param_rel_diff"] <= TOL
