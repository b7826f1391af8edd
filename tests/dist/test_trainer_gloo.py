"""`ddpgraph.integrations.transformers.CUDAGraphTrainer` in a real `transformers.Trainer` run
on gloo CPU processes (`use_cpu=True`), with the recording backend: replays run no Python, so
Trainer's loop around them (scheduler, logging, evaluation, checkpoints) must work from
what the graph leaves (tests/scenarios/trainer_train.py).

Captured runs must equal the same runs of plain Trainer with the same graph-safe
optimizer bit for bit: the losses and gradient norms Trainer logged, the learning rates
its scheduler set, evaluation losses and the final parameters. What is refused is
refused on every rank, with a code, and trains as plain Trainer does.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

from launcher import ok
from shared_launches import batched

pytestmark = pytest.mark.multiprocess
CAPTURED = ["cosine", "linear_bf16", "evaluate", "no_clipping", "dropout", "compiled"]
REFUSED = {
    "accumulate": "gradient_accumulation_steps=2",
    "one_rank_callback": "CountGrads implements `on_pre_optimizer_step`",
}
Results = dict[str, list[dict[str, Any]]]


# Run in one launch with the other modules' scenarios of the same world size (launcher.batched).
TWO = batched(
    "trainer_train.py",
    [f"recording:{n}" for n in [*CAPTURED, *REFUSED, "checkpoint_resume", "resume_same_trainer"]],
    nproc=2,
    timeout=900,
)
FOUR = batched(
    "trainer_train.py", ["recording:cosine", "recording:one_rank_callback"], nproc=4, timeout=600
)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    found = TWO.results(tmp_path_factory)
    return {name.split(":", 1)[1]: ranks for name, ranks in found.items()}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> Results:
    found = FOUR.results(tmp_path_factory)
    return {name.split(":", 1)[1]: ranks for name, ranks in found.items()}


def _captured_like_trainer(ranks: list[dict[str, Any]]) -> None:
    for r in ok(ranks):
        assert r["state"] == "captured" and r["code"] is None, r["reason"]
        stats = r["stats"]
        assert stats["captures"] == 1 and stats["eager_steps"] == 0
        assert stats["replays"] == r["steps"] - stats["warmup_steps"] > 0
        assert all(r["same"].values()), r["same"]
        assert r["param_rel_diff"] == 0.0
        assert r["restored"]  # the optimizer's own `step` is back


@pytest.mark.parametrize("name", CAPTURED)
def test_each_update_is_captured_and_trains_like_trainer(results: Results, name: str) -> None:
    _captured_like_trainer(results[name])


def test_the_schedule_logging_and_evaluation_really_ran(results: Results) -> None:
    r = ok(results["cosine"])[0]
    assert (
        len(set(r["lrs"])) == r["steps"]
    )  # warm-up then cosine: a new rate every step, after capture too
    assert (
        len(r["losses"]) == r["steps"] // 4
    )  # logging_steps=4, each an average over the graph's losses
    assert len(ok(results["evaluate"])[0]["eval_losses"]) == 3  # eval_steps=8 over 24 steps


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_cannot_be_captured_is_refused_once_and_trains_like_trainer(
    results: Results, name: str
) -> None:
    for r in ok(results[name]):
        assert r["state"] == "eager" and r["code"] == "UNSUPPORTED_SETUP", r["reason"]
        assert REFUSED[name] in r["reason"]
        assert all(r["same"].values()) and r["param_rel_diff"] == 0.0
        assert r["restored"]


def test_a_refusal_seen_on_one_rank_is_taken_by_every_rank(results: Results) -> None:
    for r in ok(results["one_rank_callback"]):
        assert r["reason"].count("[rank 1]") == 1, r["reason"]  # the rank that had the callback


def test_a_checkpoint_saved_from_the_graph_resumes_and_captures_again(results: Results) -> None:
    for r in ok(results["checkpoint_resume"]):
        assert "checkpoint-14" in r["saved_dirs"]  # Trainer's own format, from a live graph
        assert r["same_checkpoint"]  # the optimizer state saved 3 replays in equals eager's
        assert r["state"] == "captured" and r["stats"]["captures"] == 1, r
        assert r["steps"] == 32 and r["stats"]["replays"] == 18 - r["stats"]["warmup_steps"]
        assert r["same_resumed_losses"] and r["param_rel_diff"] == 0.0


def test_the_same_trainer_resumes_from_its_checkpoint_and_captures_again(results: Results) -> None:
    # Its DDP is the one the first `train()` warmed up: one eager update, then the capture.
    for r in ok(results["resume_same_trainer"]):
        assert (
            r["state"] == "captured"
            and r["stats"]["captures"] == 1
            and r["stats"]["eager_steps"] == 0
        ), r
        assert r["same_losses"] and r["param_rel_diff"] == 0.0 and r["restored"]


def test_four_ranks_capture_together_and_refuse_together(four_ranks: Results) -> None:
    _captured_like_trainer(four_ranks["cosine"])
    for r in ok(four_ranks["one_rank_callback"]):
        assert r["state"] == "eager" and "[rank 3]" in r["reason"] and r["param_rel_diff"] == 0.0
