"""Model families with CUDA graphs at the bench presets' sizes, one process per GPU
(tests/scenarios/families.py): each captured and trained as eager training with the
same graph-safe optimizer does, or refused with the exact cause. About a minute on one
H200.

At world size 1 SyncBatchNorm has no peer and computes as BatchNorm (PyTorch's
`SyncBatchNorm.forward` falls back to `F.batch_norm` when the group has one process);
its statistics' collectives inside a graph are checked at 2 and 4 CPU ranks
(tests/dist/test_families_gloo.py), and here at world size 2 where two GPUs are lent.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from launcher import gpu_world, ok, run_scenarios

pytestmark = pytest.mark.gpu
CAPTURED = ["bert", "moe_bf16", "syncbn", "ckpt", "ckpt_reentrant"]
NAMES = [*CAPTURED, "moe", "moe_eager_experts"]
# Where transformers takes another branch while a graph is recorded (an explicit mask for
# SDPA), another attention kernel in bf16 rounds differently (2.1e-4 measured on
# hf-llama, run 25); everywhere else the promise is bit for bit.
KERNEL_ROUNDING_TOL = 1e-3
Results = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = tmp_path_factory.mktemp("gpu_families")
    return run_scenarios("families.py", NAMES, Path(out), nproc=gpu_world(), timeout=400)


def _report(name: str, r: dict[str, Any]) -> None:
    warnings.warn(
        f"{name}: {r['state']} {r['code'] or ''}; against eager {r['param_rel_diff']:.2e} "
        f"(eager against itself {r['control_rel_diff']:.2e}), buffers {r['buffer_rel_diff']:.2e}, "
        f"stats {r['stats']}; reason: {r['reason']}",
        stacklevel=2,
    )


def _captured(name: str, r: dict[str, Any]) -> None:
    _report(name, r)
    assert r["state"] == "captured" and r["code"] is None, r["reason"]
    assert r["stats"]["replays"] == r["steps"] - r["stats"]["warmup_steps"] > 0
    assert r["losses_finite"]
    assert r["param_rel_diff"] <= max(KERNEL_ROUNDING_TOL, 2 * r["control_rel_diff"]), r


@pytest.mark.parametrize("name", CAPTURED)
def test_each_family_is_captured_and_trains_like_eager(results: Results, name: str) -> None:
    for r in ok(results[name]):
        _captured(name, r)


def test_sync_batch_norm_on_one_process_is_batch_norm_and_bit_for_bit(results: Results) -> None:
    for r in ok(results["syncbn"]):
        assert r["param_rel_diff"] == 0.0 and r["buffer_rel_diff"] == 0.0, r


def test_grouped_expert_routing_in_fp32_weights_is_captured_or_refused_naming_the_fix(
    results: Results,
) -> None:
    # bf16 autocast with fp32 expert weights: transformers casts the activations to the
    # weights' dtype, and PyTorch's CUDA grouped product for anything but bf16 loops over
    # offsets it reads on the host. Either way the outcome must be exact.
    for r in ok(results["moe"]):
        _report("moe", r)
        if r["state"] == "captured":
            _captured("moe", r)
        else:
            assert r["code"] == "HOST_SYNC_IN_CAPTURE" and "moe.py" in r["reason"], r["reason"]
            assert "bfloat16" in r["reason"] and "batched_mm" in r["reason"], r["reason"]
            assert r["same_losses"] and r["param_rel_diff"] == 0.0


def test_the_per_expert_loop_is_refused_with_its_line_and_the_setting(results: Results) -> None:
    for r in ok(results["moe_eager_experts"]):
        _report("moe_eager_experts", r)
        assert r["state"] == "eager" and r["code"] == "HOST_SYNC_IN_CAPTURE", r["reason"]
        assert (
            "modeling_mixtral.py" in r["reason"]
            and 'experts_implementation="grouped_mm"' in r["reason"]
        )
        assert r["same_losses"] and r["param_rel_diff"] == 0.0
