"""Adopting a DDP built with `DDP(...)`: 2 gloo processes, tests/scenarios/cpu_adopt.py.

The reducer rebuild is what PyTorch without the override switch (2.11) needs on the
GPU; on CPU it runs the same code without a stream, so what it must preserve (training
bit for bit, every DDP setting, fresh accumulator nodes, rank agreement) is checked here.
"""

from __future__ import annotations

from typing import Any

import pytest

from launcher import ok
from shared_launches import batched

pytestmark = pytest.mark.multiprocess

SETTINGS = ["default", "small_buckets", "bucket_view", "static_graph", "no_broadcast"]
TRAINED = [*SETTINGS, "fresh", "python_comm_hook", "ignored_params"]
OTHERS = ["nodes_are_new", "stale_graph_refused", "builtin_hook_refused", "override_switch"]
Results = dict[str, list[dict[str, Any]]]


# Run in one launch with the other modules' scenarios of the same world size (launcher.batched).
TWO = batched("cpu_adopt.py", TRAINED + OTHERS, nproc=2, timeout=300)
FOUR = batched("cpu_adopt.py", ["fresh", "stale_graph_refused"], nproc=4, timeout=300)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    return TWO.results(tmp_path_factory)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Results:
    return FOUR.results(tmp_path_factory)


def test_four_ranks_adopt_together_or_refuse_together(four: Results) -> None:
    """With 4 ranks the sum order of gloo's ring depends on the bucket layout, which a
    rebuild before the first step leaves as it was: still bit for bit."""
    for r in ok(four["fresh"]):
        assert r["refusal"] is None and r["bitwise"], r
    for r in ok(four["stale_graph_refused"]):
        assert r["code"] == "DDP_STREAM_MISMATCH" and "only on rank 1" in r["reason"]
        assert r["param_rel_diff"] == 0.0


@pytest.mark.parametrize("name", TRAINED)
def test_adopted_ddp_trains_like_the_original_bit_for_bit(results: Results, name: str) -> None:
    for r in ok(results[name]):
        assert r["refusal"] is None, r["refusal"]
        assert r["new_reducer"]
        assert r["bitwise"] and r["param_rel_diff"] == 0.0 and r["loss_rel_diff"] == 0.0, r
        # 12 forwards after the rebuild: the warm-up count starts again at the rebuild.
        assert r["counter"] == 12


@pytest.mark.parametrize("name", TRAINED)
def test_every_ddp_setting_survives_adoption(results: Results, name: str) -> None:
    for r in ok(results[name]):
        assert r["same_settings"], r["settings"]


def test_settings_under_test_are_really_set(results: Results) -> None:
    """Guards the comparison above against comparing defaults with defaults."""
    settings = {name: ok(results[name])[0]["settings"]["attrs"] for name in TRAINED}
    assert settings["bucket_view"]["gradient_as_bucket_view"]
    assert settings["static_graph"]["static_graph"]
    assert not settings["no_broadcast"]["broadcast_buffers"]
    assert settings["small_buckets"]["bucket_bytes_cap"] < settings["default"]["bucket_bytes_cap"]
    assert settings["python_comm_hook"]["hooks"] == ["allreduce_hook"]
    assert ok(results["python_comm_hook"])[0]["settings"]["logged"]["comm_hook"] == "allreduce_hook"
    assert settings["ignored_params"]["ignored"] == ["b.bias", "b.weight"]


def test_the_rebuilt_reducer_holds_new_accumulator_nodes(results: Results) -> None:
    for r in ok(results["nodes_are_new"]):
        assert r["params"] == 8 and r["stale"] == 0 and r["still_old"] == 0


def test_a_kept_graph_on_one_rank_makes_every_rank_refuse(results: Results) -> None:
    for r in ok(results["stale_graph_refused"]):
        assert r["code"] == "DDP_STREAM_MISMATCH"
        assert "earlier step" in r["reason"] and "only on rank 1" in r["reason"]
        assert r["param_rel_diff"] == 0.0  # training goes on exactly as before


def test_a_builtin_comm_hook_is_refused_by_name(results: Results) -> None:
    for r in ok(results["builtin_hook_refused"]):
        assert r["code"] == "DDP_STREAM_MISMATCH"
        assert "BuiltinCommHookType.ALLREDUCE" in r["reason"]
        assert r["untouched"]


def test_the_override_switch_is_used_where_it_exists(results: Results) -> None:
    for r in ok(results["override_switch"]):
        assert not r["refusal"]
        if r["has"]:
            assert r["switch_on"] and r["same_reducer"]
        else:
            assert not r["same_reducer"]
