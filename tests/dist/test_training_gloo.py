"""Training-loop pieces across 2 processes (torchrun + gloo on CPU, both CPU backends).

What only several ranks can show: a non-finite gradient on one rank makes every rank skip
(also when it arrives in a micro-batch under `no_sync`), accumulation all-reduces once per
step, the monitor raises on every rank at the same call, every rank resumes from its own
checkpoint, and evaluation between steps (with DDP's buffer broadcast) changes nothing.
Every captured run equals its eager run bit for bit, with the stand-in backend and with
the recording backend, whose replays run no Python (`recording:NAME`, one launch).
"""

from __future__ import annotations

from typing import Any

import pytest

from launcher import ok
from shared_launches import batched
from variants import both_backends, key

pytestmark = pytest.mark.multiprocess

NAMES = ["scaler_agreement", "accumulation", "monitor", "checkpoint_resume", "eval_between_steps"]
Results = dict[str, list[dict[str, Any]]]


# Run in one launch with the other modules' scenarios of the same world size (launcher.batched).
LAUNCH = batched("cpu_training.py", both_backends(NAMES), nproc=2, timeout=300)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    return LAUNCH.results(tmp_path_factory)


def _equal(r: dict[str, Any]) -> None:
    assert r["bitwise"], r
    assert r["loss_rel_diff"] == 0 and r["param_rel_diff"] == 0 and r["state_rel_diff"] == 0


def test_inf_gradient_on_one_rank_is_skipped_on_every_rank(results: Results, variant: str) -> None:
    ranks = ok(results[key("scaler_agreement", variant)])
    for variant in ("plain", "no_sync"):
        for r in ranks:
            v = r[variant]
            assert v["state"] == "captured" and v["stats"]["replays"] == 5, v
            _equal(v)
            assert v["scales"] == v["ref_scales"]
            # Backed off at the poisoned steps 4 and 13 (warm-up and replay), on every rank.
            assert (
                v["scales"][4] == v["scales"][3] / 2 and v["scales"][13] == v["scales"][12] / 2
            ), v["scales"]
        assert ranks[0][variant]["params_at_end"] == ranks[1][variant]["params_at_end"]


def test_accumulation_all_reduces_once_per_step(results: Results, variant: str) -> None:
    ranks = ok(results[key("accumulation", variant)])
    for r in ranks:
        _equal(r)
        assert r["state"] == "captured" and r["stats"]["warmup_steps"] == 11
        assert r["allreduces_eager"] == 14  # 14 steps of 4 micro-batches, one bucket
        # The hook's Python runs in warm-up and recording: the stand-in also runs it in
        # each of the 3 replays, a recorded replay (as a CUDA graph) only all-reduces.
        assert r["allreduces_captured"] == (15 if variant == "pass-through" else 12)
    assert ranks[0]["param_sums"] == ranks[1]["param_sums"]


def test_monitor_raises_on_every_rank_one_step_late(results: Results, variant: str) -> None:
    for r in ok(results[key("monitor", variant)]):
        assert r["state"] == "captured" and r["raised_at"] == 13
        assert r["error_code"] == "NON_FINITE_LOSS" and r["ranks"] == [1]
        assert "step 12" in r["message"] and "rank 1" in r["message"]
        assert len(r["logged"]) == 12 and all(v["grad_norm"] > 0 for v in r["logged"])


def test_every_rank_resumes_from_its_checkpoint(results: Results, variant: str) -> None:
    for r in ok(results[key("checkpoint_resume", variant)]):
        _equal(r)
        assert r["steps"] == 16 and r["state"] == "captured" and r["stats"]["replays"] == 5


def test_evaluation_between_steps_changes_nothing(results: Results, variant: str) -> None:
    for r in ok(results[key("eval_between_steps", variant)]):
        for how in ("ddp", "module"):
            _equal(r[how])
            assert r[how]["eval_rel_diff"] == 0 and r[how]["evals"] == 12
            # Through DDP, the first step after each eval forward runs eagerly: eager DDP
            # skips its buffer broadcast there (evals after steps 11, 14 and 17).
            eager = 3 if how == "ddp" else 0
            assert r[how]["state"] == "captured" and r[how]["stats"]["eager_steps"] == eager
