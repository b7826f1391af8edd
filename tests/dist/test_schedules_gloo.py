"""Every hyper-parameter a schedule changes stays live in the graph, across 2 and 4
processes (torchrun + gloo on CPU): OneCycleLR and CyclicLR cycling AdamW's and Adam's
`betas[0]` and SGD's `momentum` (through ddpgraph's own update), ChainedScheduler,
SequentialLR, ReduceLROnPlateau, and transformers' cosine and linear warm-up schedules on
a GPT-2 fed by a DataLoader. Every run stays captured from the first replay on, on every
rank, and equals eager training with the same settings bit for bit. At 2 ranks with the
stand-in backend and the recording backend (replays run no Python), at 4 ranks with the
recording backend, one launch each."""

from __future__ import annotations

from typing import Any

import pytest

from launcher import ok
from shared_launches import batched
from variants import VARIANTS, both_backends, key

pytestmark = pytest.mark.multiprocess

SCRIPT = "cpu_schedules.py"
# Which hyper-parameters a scenario's schedule changes after capture: (lr, betas, momentum).
CHANGES = {
    "adamw_one_cycle": (True, True, False),
    "adam_cyclic": (True, True, False),
    "sgd_nesterov_cyclic_accumulated": (True, False, True),
    "sgd_chained": (True, False, True),
    "adamw_sequential": (True, False, False),
    "adamw_plateau": (True, False, False),
    "gpt2_hf_cosine": (True, False, False),
    "gpt2_hf_linear": (True, False, False),
}
SCENARIOS = [*CHANGES, "sgd_momentum_set_after_capture"]
Results = dict[str, list[dict[str, Any]]]


# Run in one launch with the other modules' scenarios of the same world size (launcher.batched).
LAUNCHES = {
    2: batched(SCRIPT, both_backends(SCENARIOS), nproc=2, timeout=420),
    4: batched(
        SCRIPT,
        [f"recording:{n}" for n in SCENARIOS if "recording" in VARIANTS],
        nproc=4,
        timeout=420,
    ),
}


@pytest.fixture(scope="module", params=[2, 4], ids=["2proc", "4proc"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Results:
    return LAUNCHES[int(request.param)].results(tmp_path_factory)


def _ranks(results: Results, name: str, variant: str) -> list[dict[str, Any]]:
    if key(name, variant) not in results:
        pytest.skip(f"{name} runs with the {variant} backend at 2 ranks only")
    ranks = ok(results[key(name, variant)])
    assert [r["rank"] for r in ranks] == list(range(ranks[0]["world_size"]))
    return ranks


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_schedule_stays_captured_on_every_rank_and_equals_eager(
    results: Results, variant: str, name: str
) -> None:
    ranks = _ranks(results, name, variant)
    for r in ranks:
        assert r["states"] == ["warmup"] * 11 + ["captured"] * 9 and r["code"] is None, r
        assert r["captures"] == 1 and r["replays"] == 9, r
        assert r["param_rel_diff"] == 0 and r["loss_rel_diff"] == 0, r
        # The schedule did change what it changes after capture (so the test can fail).
        changed = [n > 1 for n in r["distinct_after_capture"]]
        assert changed == list(CHANGES[name]), r["distinct_after_capture"]
        assert r["user_values_are_numbers"], r
    assert len({r["param_sum"] for r in ranks}) == 1  # DDP keeps the ranks together


def test_momentum_set_after_capture_is_captured_again_on_every_rank_together(
    results: Results, variant: str
) -> None:
    ranks = _ranks(results, "sgd_momentum_set_after_capture", variant)
    for r in ranks:
        # Seen at call 15 (0-based 14), which runs eagerly (the state says so while the
        # report waits) until the agreement at call 16, then one probe step and a new
        # capture with ddpgraph's own update.
        assert (
            r["states"]
            == ["warmup"] * 11 + ["captured"] * 3 + ["eager", "warmup"] + ["captured"] * 4
        ), r
        assert r["captures"] == 2 and r["code"] is None, r
        assert r["param_rel_diff"] == 0 and r["loss_rel_diff"] == 0, r
    assert len({r["param_sum"] for r in ranks}) == 1
