"""`ddpgraph.integrations.transformers.CUDAGraphTrainer` with CUDA graphs: a `transformers.Trainer`
run (GPT-2 from a config, bf16 or fp32, cosine or linear schedule with warm-up,
clipping, logging, evaluation, checkpoints, `torch_compile`), one process per GPU (at
world size 1 Trainer still trains a DDP model under torchrun), against the same run
of plain Trainer with the same graph-safe optimizer (tests/scenarios/trainer_train.py).
About 1.5 minutes on one H200, most of it inductor compiling for `compiled`."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from launcher import gpu_world, ok, run_scenarios, scenarios_for_world

pytestmark = pytest.mark.gpu
CAPTURED = ["cosine", "linear_bf16", "evaluate", "no_clipping", "dropout"]
NAMES = [
    *CAPTURED,
    "compiled",
    "accumulate",
    "checkpoint_resume",
    "resume_same_trainer",
    "one_rank_callback",
]
# Inductor's kernels are the same in both runs; what is left is the order of
# floating-point reductions across the graph's boundary (the presets' bound).
COMPILED_TOL = 1e-3
Results = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = tmp_path_factory.mktemp("gpu_trainer")
    names = scenarios_for_world(NAMES, {"one_rank_callback"})
    return run_scenarios("trainer_train.py", names, Path(out), nproc=gpu_world(), timeout=400)


def _captured(r: dict[str, Any]) -> None:
    stats = r["stats"]
    assert r["state"] == "captured" and r["code"] is None, r["reason"]
    # A call whose capture Dynamo compiled during runs eagerly, and capture starts afresh
    # (`restarts`); any other eager call is a failure.
    assert stats["captures"] == 1 and stats["eager_steps"] == stats.get("restarts", 0), (
        stats,
        r.get("eager_reason"),
    )
    assert stats["replays"] == r["steps"] - stats["warmup_steps"] - stats["eager_steps"] > 0
    assert r["restored"]


@pytest.mark.parametrize("name", CAPTURED)
def test_each_update_is_captured_and_trains_like_trainer(results: Results, name: str) -> None:
    for r in ok(results[name]):
        warnings.warn(
            f"{name}: {r['param_rel_diff']:.2e} against plain Trainer, same = {r['same']}, "
            f"seconds = {r['seconds']}",
            stacklevel=1,
        )
        _captured(r)
        assert r["param_rel_diff"] == 0.0 and all(r["same"].values()), r["same"]


def test_torch_compile_true_is_captured_around_the_compiled_model(results: Results) -> None:
    for r in ok(results["compiled"]):
        warnings.warn(
            f"compiled: {r['param_rel_diff']:.2e} against plain compiled Trainer", stacklevel=1
        )
        _captured(r)
        assert (
            r["param_rel_diff"] <= COMPILED_TOL and r["same"]["lrs"] and r["same"]["train_mode"]
        ), r


def test_gradient_accumulation_is_refused_and_trains_as_trainer_does(results: Results) -> None:
    for r in ok(results["accumulate"]):
        assert r["state"] == "eager" and r["code"] == "UNSUPPORTED_SETUP", r["reason"]
        assert r["param_rel_diff"] == 0.0 and all(r["same"].values())


def test_a_checkpoint_saved_from_the_graph_resumes_and_captures_again(results: Results) -> None:
    for r in ok(results["checkpoint_resume"]):
        assert "checkpoint-14" in r["saved_dirs"] and r["same_checkpoint"], r
        assert r["state"] == "captured" and r["stats"]["captures"] == 1, r
        assert r["same_resumed_losses"] and r["param_rel_diff"] == 0.0


def test_the_same_trainer_resumes_from_its_checkpoint_and_captures_again(results: Results) -> None:
    for r in ok(results["resume_same_trainer"]):
        assert r["state"] == "captured" and r["stats"]["captures"] == 1, r
        assert r["same_losses"] and r["param_rel_diff"] == 0.0


@pytest.mark.two_ranks
def test_a_refusal_on_one_rank_is_taken_by_every_rank(results: Results) -> None:
    for r in ok(results["one_rank_callback"]):
        assert r["state"] == "eager" and "[rank 1]" in r["reason"] and r["param_rel_diff"] == 0.0
