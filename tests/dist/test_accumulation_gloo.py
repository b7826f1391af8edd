"""Accumulation across calls with `ddp.no_sync()` is refused on every rank together, and
trains as eager DDP does: ranks identical, parameters equal to the eager loop's.

tests/scenarios/cpu_accumulation.py runs each loop captured and eagerly, at 2 and 4
processes, with the stand-in and the recording backend (which replays the recorded
collectives as a CUDA graph would: a graph recorded on a `no_sync` call never
all-reduces). One torchrun launch per world size.
"""

from __future__ import annotations

from typing import Any

import pytest

from launcher import ok
from shared_launches import batched
from variants import both_backends, key

pytestmark = pytest.mark.multiprocess

SCRIPT = "cpu_accumulation.py"
CYCLES = [2, 3, 4, 5]
WHERE = ["outside", "argument", "flag"]
SCENARIOS = [f"{w}_M{m}" for w in WHERE for m in CYCLES] + ["after_capture"]
PROBE_CALL = 11  # the default warm-up of a fresh DDP model ends with the probe step
Results = dict[str, list[dict[str, Any]]]


# Run in one launch with the other modules' scenarios of the same world size (launcher.batched).
LAUNCHES = {n: batched(SCRIPT, both_backends(SCENARIOS), nproc=n, timeout=400) for n in (2, 4)}


@pytest.fixture(scope="module", params=[2, 4], ids=["2proc", "4proc"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Results:
    return LAUNCHES[int(request.param)].results(tmp_path_factory)


def _trained_as_eager(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["param_rel_diff"] == 0.0 and r["loss_rel_diff"] == 0.0, r
        assert r["from_rank0"] == 0.0 and r["eager_from_rank0"] == 0.0, r
    assert len({repr(r["states"]) for r in ranks}) == 1, [r["states"] for r in ranks]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("m", CYCLES)
def test_accumulation_across_calls_is_refused_at_the_probe_step(
    results: Results, variant: str, where: str, m: int
) -> None:
    ranks = ok(results[key(f"{where}_M{m}", variant)])
    _trained_as_eager(ranks)
    for r in ranks:
        assert r["state"] == "eager" and r["code"] == "UNSUPPORTED_SETUP", r
        assert "no_sync" in r["happened"], r
        assert r["line"] == "losses.append(float(step(*args)))", r  # the call under no_sync()
        assert r["stats"]["replays"] == 0 and r["stats"]["captures"] == 0, r
    states = ranks[0]["states"]
    # Refused on the probe step's agreement, wherever the probe fell in the M cycle.
    assert states[: PROBE_CALL - 1] == ["warmup"] * (PROBE_CALL - 1), states
    assert set(states[PROBE_CALL - 1 :]) == {"eager"}, states


def test_accumulation_that_starts_after_capture_runs_eagerly_from_its_first_call(
    results: Results, variant: str
) -> None:
    ranks = ok(results[key("after_capture", variant)])
    _trained_as_eager(ranks)
    for r in ranks:
        assert r["state"] == "eager" and r["code"] == "UNSUPPORTED_SETUP", r
        assert r["stats"]["captures"] == 1 and r["stats"]["replays"] == 24 - PROBE_CALL, r
        assert r["line"] == "losses.append(float(step(*args)))", r
    states = ranks[0]["states"]
    assert states[PROBE_CALL:24] == ["captured"] * (24 - PROBE_CALL), states
    assert set(states[24:]) == {"eager"}, states  # from the first `no_sync` call on
