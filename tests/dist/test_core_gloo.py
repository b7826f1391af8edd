"""`capture_step` across processes: torchrun + gloo on CPU, with both CPU backends.

Every scenario of tests/scenarios/cpu_core.py runs in one torchrun launch per
configuration (2 processes, 4 processes, and a 2-node job on localhost that goes
through torchrun's c10d rendezvous as separate hosts would), once with the stand-in
backend and once with the recording backend (`recording:NAME`), which replays the
recorded operations and collectives as a CUDA graph would; the tests assert on the
JSON each rank wrote. What they check is that all ranks take the same path on the same
call, that nothing hangs, and that training equals the eager loop bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest

from launcher import ok, run_scenarios_multinode
from shared_launches import batched, prefetched_in
from variants import both_backends, key

pytestmark = pytest.mark.multiprocess

SCRIPT = "cpu_core.py"
SCENARIOS = [
    "equivalence",
    "fail_one_rank",
    "fail_one_rank_raise",
    "schedule_inside_on_one_rank",
    "refusal_on_one_rank",
    "input_change_on_one_rank",
    "no_backend_on_cpu",
    "float_lr_after_capture",
]
# What only a backend that replays without Python can show.
RECORDING_ONLY = ["host_read_in_backward_on_one_rank", "submodule_switched"]
MULTINODE_SCENARIOS = ["equivalence", "fail_one_rank"]
# At 4 ranks the recording backend runs what depends on pairing the ranks' replays and
# failures (these and RECORDING_ONLY); the rest only at 2 ranks, to keep CI's time.
RECORDED_AT_4 = ["equivalence", "fail_one_rank", "input_change_on_one_rank", *RECORDING_ONLY]
Results = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module", params=[2, 4], ids=["2proc", "4proc"])
def nproc(request: pytest.FixtureRequest) -> int:
    return int(request.param)


# Run in one launch with the other modules' scenarios of the same world size (launcher.batched).
LAUNCHES = {
    2: batched(SCRIPT, both_backends(SCENARIOS, RECORDING_ONLY), nproc=2, timeout=240),
    4: batched(SCRIPT, [*SCENARIOS, *both_backends([], RECORDED_AT_4)], nproc=4, timeout=240),
}


@pytest.fixture(scope="module")
def results(nproc: int, tmp_path_factory: pytest.TempPathFactory) -> Results:
    return LAUNCHES[nproc].results(tmp_path_factory)


# Two torchrun agents meeting as two hosts would: run in the background too.
MULTINODE = prefetched_in(
    "two_nodes",
    lambda out: run_scenarios_multinode(
        SCRIPT, both_backends(MULTINODE_SCENARIOS), out, nnodes=2, nproc_per_node=1, timeout=240
    ),
)


@pytest.fixture(scope="module")
def multinode() -> Results:
    return MULTINODE.result()


def _ranks(results: Results, name: str, variant: str = "pass-through") -> list[dict[str, Any]]:
    if key(name, variant) not in results:
        pytest.skip(f"{name} runs with the {variant} backend at 2 ranks only")
    ranks = ok(results[key(name, variant)])
    world = ranks[0]["world_size"]
    assert [r["rank"] for r in ranks] == list(range(world))
    assert all(r["world_size"] == world for r in ranks)
    return ranks


def _check_equivalence(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0, r
        assert r["state"] == "closed"  # closed after training captured
        assert r["code"] is None
        assert r["states"] == ["warmup"] * 11 + ["captured"] * 19
        stats = r["stats"]
        assert (stats["captures"], stats["replays"], stats["eager_steps"]) == (1, 19, 0)


def _check_fail_one_rank(ranks: list[dict[str, Any]]) -> None:
    world = len(ranks)
    for r in ranks:
        assert r["state"] == "eager", r
        assert r["code"] == "CAPTURE_FAILED"
        assert r["ranks"] == [world - 1]
        assert "injected" in r["reason"]
        assert f"only on rank {world - 1}" in r["reason"]
        assert r["states"] == ["warmup"] * 11 + ["eager"] * 9  # every rank on the same call
        assert r["stats"]["captures"] == 0
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0


def test_world_size_comes_from_torchrun(results: Results, nproc: int, variant: str) -> None:
    for name in SCENARIOS:
        assert len(_ranks(results, name, variant)) == nproc


def test_equivalence(results: Results, variant: str) -> None:
    _check_equivalence(_ranks(results, "equivalence", variant))


def test_fail_one_rank(results: Results, variant: str) -> None:
    _check_fail_one_rank(_ranks(results, "fail_one_rank", variant))


def test_fail_one_rank_raise(results: Results, variant: str) -> None:
    ranks = _ranks(results, "fail_one_rank_raise", variant)
    world = len(ranks)
    for r in ranks:
        assert r["raised_at"] == 11, r  # the capture call, on every rank
        assert r["code"] == "CAPTURE_FAILED"
        assert r["ranks"] == [world - 1]
        assert r["unchanged"] is True


def test_schedule_inside_on_one_rank(results: Results, variant: str) -> None:
    ranks = _ranks(results, "schedule_inside_on_one_rank", variant)
    world = len(ranks)
    for r in ranks:
        assert r["state"] == "eager", r
        assert r["code"] == "LR_BAKED_INTO_GRAPH"
        assert r["ranks"] == [world - 1]
        assert r["stats"]["captures"] == 0 and r["stats"]["warmup_steps"] == 11
        # Every rank names the line of the rank that changed it.
        assert r["line"][0].endswith("cpu_core.py") and r["line"][2].endswith(".mul_(0.99)"), r


def test_refusal_on_one_rank(results: Results, variant: str) -> None:
    ranks = _ranks(results, "refusal_on_one_rank", variant)
    world = len(ranks)
    for r in ranks:
        assert r["state"] == "eager", r
        assert r["code"] == "OPTIMIZER_NOT_CAPTURABLE"
        assert r["ranks"] == [world - 1]
        assert "Adagrad" in r["reason"]
        assert r["stats"]["warmup_steps"] == 0 and r["stats"]["eager_steps"] == 3


def test_input_change_on_one_rank(results: Results, variant: str) -> None:
    ranks = _ranks(results, "input_change_on_one_rank", variant)
    last = len(ranks) - 1
    for r in ranks:
        changed = r["rank"] == last
        assert r["state"] == "captured", r
        assert r["stats"]["input_changes"] == (1 if changed else 0)
        assert r["stats"]["eager_steps"] == (1 if changed else 0)
        assert r["stats"]["replays"] == (8 if changed else 9)
        assert len(r["warnings"]) == (1 if changed else 0)
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0
    [warning] = ranks[last]["warnings"]
    assert "INPUT_SIGNATURE_CHANGED" in warning and "(5, 16)" in warning


def test_a_submodule_switched_or_reset_after_capture_runs_eagerly_on_every_rank(
    results: Results,
) -> None:
    for r in _ranks(results, "submodule_switched", "recording"):
        assert r["state"] == "closed" and r["code"] is None, r
        stats = r["stats"]
        assert (stats["input_changes"], stats["eager_steps"], stats["replays"]) == (4, 4, 5)
        [switched, reset] = r["warnings"]
        assert "`module.1` (BatchNorm1d)" in switched and "switched to eval mode" in switched
        assert "[MODULE_SETTING_CHANGED]" in reset and "`module.1.momentum`" in reset
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0
        assert r["buffer_rel_diff"] == 0.0


def test_no_backend_on_cpu(results: Results, variant: str) -> None:
    ranks = _ranks(results, "no_backend_on_cpu", variant)
    for r in ranks:
        assert r["state"] == "eager", r
        assert r["code"] == "NO_CUDA"
        assert r["ranks"] == list(range(len(ranks)))
        assert r["stats"]["eager_steps"] == 3


def test_float_lr_after_capture(results: Results, variant: str) -> None:
    """A replay keeps the float lr it was recorded with (what a GPU does, silently); the
    stand-in re-runs Python, reads lr=0 and makes no update, so it cannot show this."""
    for r in _ranks(results, "float_lr_after_capture", variant):
        at_recorded_lr, at_zero = r["update_at_lr"]
        assert at_recorded_lr > 0, r
        if variant == "recording":
            assert at_zero > 0.5 * at_recorded_lr, r
        else:
            assert at_zero == 0.0, r


def test_host_read_in_backward_on_one_rank(results: Results) -> None:
    """The capture fails on one rank in the middle of backward; all ranks fall back, the
    reducer is reset (without the reset the next eager backward fails: a gradient
    marked ready twice), and training equals the eager loop bit for bit."""
    ranks = _ranks(results, "host_read_in_backward_on_one_rank", "recording")
    last = len(ranks) - 1
    for r in ranks:
        assert r["state"] == "eager", r
        assert r["code"] == "HOST_SYNC_IN_CAPTURE" and r["ranks"] == [last]
        filename, _, source = r["line"]
        assert filename.endswith("cpu_core.py") and "float(g.abs().sum())" in source
        assert r["states"] == ["warmup"] * 11 + ["eager"] * 5
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0


def test_two_nodes_world_size(multinode: Results, variant: str) -> None:
    for name in MULTINODE_SCENARIOS:
        ranks = _ranks(multinode, name, variant)
        assert len(ranks) == 2
        assert all(r["world_size"] == 2 for r in ranks)


def test_two_nodes_equivalence(multinode: Results, variant: str) -> None:
    _check_equivalence(_ranks(multinode, "equivalence", variant))


def test_two_nodes_fail_one_rank(multinode: Results, variant: str) -> None:
    _check_fail_one_rank(_ranks(multinode, "fail_one_rank", variant))
