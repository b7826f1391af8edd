"""`capture_step` adopts a DDP built with `DDP(model.cuda(), device_ids=[rank])` on the
default stream, and trains equal to the same DDP trained eagerly with the same
graph-safe optimizer. Works at world size 1 (`DDPGRAPH_GPU_WORLD=1`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from launcher import gpu_world, ok, run_scenarios

pytestmark = pytest.mark.gpu
NAMES = ["plain", "find_unused", "bucket_view", "static_graph", "small_buckets", "trained_before"]
TOL = 1e-5  # the project's bound; expected bit for bit, printed below


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("gpu_adopt")
    names = [*NAMES, "mixed_precision_rebuilt", "kept_loss"]
    return run_scenarios("gpu_adopt.py", names, Path(out), nproc=gpu_world(), timeout=600)


@pytest.mark.parametrize("name", NAMES)
def test_default_stream_ddp_is_captured_and_trains_like_eager(
    results: dict[str, list[dict[str, Any]]], name: str
) -> None:
    for r in ok(results[name]):
        print(
            f"{name} rank {r['rank']}: bitwise equal = {r['bitwise_equal']}, "
            f"override switch = {r['override_switch']}, reason = {r['reason']}"
        )
        assert r["code"] is None, r["reason"]
        assert r["states"][:11] == ["warmup"] * 11
        assert r["states"][11:] == ["captured"] * (len(r["states"]) - 11)
        assert r["stats"]["replays"] == len(r["states"]) - 11
        assert r["loss_rel_diff"] <= TOL and r["param_rel_diff"] <= TOL, r
        assert r["bitwise_equal"], "same kernels, same data: expected bit for bit"


def test_ddp_mixed_precision_is_refused_by_name(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    # A rebuilt reducer under DDP's prototype mixed precision trained 7% apart from the
    # same DDP not rebuilt (H200, torch 2.11): adoption refuses it and names it.
    # The refused model must train on exactly as one never offered. DDP's mixed precision
    # repeats itself bit for bit only on a GPU to itself: beside other jobs its side-stream
    # copies race (run 65: a never-offered model trained twice, up to 2e-3 apart, in 10 of
    # 18 runs side by side; alone, 3 of 3 equal), and then there is no exact reference.
    for r in ok(results["mixed_precision_rebuilt"]):
        assert r["refusal"] is not None and "mixed_precision" in r["refusal"], r["refusal"]
        if not r["repeats_bitwise"]:
            pytest.skip(
                "DDP's mixed precision did not repeat itself bit for bit in this run "
                f"({r['repeat_rel_diff']:.1e} apart, never offered to ddpgraph): no exact reference"
            )
        assert r["bitwise_equal"], r["param_rel_diff"]


def test_a_loss_kept_from_an_earlier_step_is_named(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    for r in ok(results["kept_loss"]):
        if r["override_switch"]:
            pytest.skip("PyTorch's override switch adopts without rebuilding the accumulators")
        assert r["code"] == "DDP_STREAM_MISMATCH" and "earlier step" in r["reason"], r["reason"]
        assert set(r["states"]) == {"eager"}
