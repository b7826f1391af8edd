"""`capture_step` fed by a real `DataLoader(num_workers=2, persistent_workers=True)`, at 2
and 4 gloo processes, with both CPU backends (tests/scenarios/cpu_feeds.py, one torchrun
launch per world size): a capture that fails on one rank turns every rank eager on the
same call, the loader keeps feeding, and every sample is trained on exactly once per
epoch, as in the eager loop; a capture that succeeds replays every later batch.
"""

from __future__ import annotations

from typing import Any

import pytest

from launcher import ok
from shared_launches import batched
from variants import both_backends, key

pytestmark = pytest.mark.multiprocess

SCRIPT = "cpu_feeds.py"
SCENARIOS = ["loader_fail_one_rank", "loader_captured"]
EPOCHS, WARMUP = 2, 11
Results = dict[str, list[dict[str, Any]]]


# Run in one launch with the other modules' scenarios of the same world size (launcher.batched).
LAUNCHES = {n: batched(SCRIPT, both_backends(SCENARIOS), nproc=n, timeout=300) for n in (2, 4)}


@pytest.fixture(scope="module", params=[2, 4], ids=["2proc", "4proc"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Results:
    return LAUNCHES[int(request.param)].results(tmp_path_factory)


def _ranks(results: Results, name: str, variant: str) -> list[dict[str, Any]]:
    ranks = ok(results[key(name, variant)])
    assert [r["rank"] for r in ranks] == list(range(ranks[0]["world_size"]))
    return ranks


def _every_sample_once_per_epoch(r: dict[str, Any]) -> None:
    assert r["indices_fed"] == r["samples"] and r["fed_per_index"] == [EPOCHS], r
    assert r["trained_per_index"] == [float(EPOCHS)], r
    assert r["reference_trained_per_index"] == [float(EPOCHS)], r


def test_a_capture_failing_on_one_rank_loses_and_repeats_no_batch(
    results: Results, variant: str
) -> None:
    ranks = _ranks(results, "loader_fail_one_rank", variant)
    world = len(ranks)
    calls = len(ranks[0]["states"])
    for r in ranks:
        _every_sample_once_per_epoch(r)
        # Every rank fell back on the capture call, together, naming the failing rank.
        assert r["states"] == ["warmup"] * WARMUP + ["eager"] * (calls - WARMUP), r["states"]
        assert (
            r["state"] == "eager" and r["code"] == "CAPTURE_FAILED" and r["ranks"] == [world - 1]
        ), r
        assert r["stats"]["replays"] == 0 and r["stats"]["eager_steps"] == calls - WARMUP
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0, r


def test_the_loader_feeds_a_captured_step(results: Results, variant: str) -> None:
    for r in _ranks(results, "loader_captured", variant):
        _every_sample_once_per_epoch(r)
        calls = len(r["states"])
        assert r["states"] == ["warmup"] * WARMUP + ["captured"] * (calls - WARMUP), r["states"]
        assert r["state"] == "captured" and r["code"] is None
        assert r["stats"]["replays"] == calls - WARMUP and r["stats"]["eager_steps"] == 0
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0, r
