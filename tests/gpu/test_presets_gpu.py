"""Bench presets and `capture_step(compile=True)` on GPUs (scenarios in
tests/scenarios/gpu_presets.py, one torchrun launch; about a minute on one H200, most
of it inductor compiling the small GPT of the compile switch)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from launcher import gpu_world, ok, run_scenarios

pytestmark = pytest.mark.gpu
PRESETS = ["hf-gpt2", "hf-llama", "timm-vit", "tv-resnet50"]
NAMES = [f"preset_{p.replace('-', '_')}" for p in PRESETS] + ["fused_adamw", "compile_switch"]
NAMES += ["parity_llama_exact", "parity_llama_tolerant", "parity_gpt2_exact"]
# Compiled kernels are the same in the captured run and its eager reference; what is
# left is the order of floating-point reductions across the graph boundary.
COMPILED_TOL = 1e-3
# Another attention kernel in bf16, over the few steps of these runs (2.1e-4 measured on
# hf-llama, run 25).
KERNEL_ROUNDING_TOL = 1e-3


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("gpu_presets")
    return run_scenarios("gpu_presets.py", NAMES, Path(out), nproc=gpu_world(), timeout=600)


def _captures(ranks: list[dict[str, Any]]) -> None:
    for r in ok(ranks):
        if "skipped" in r:
            pytest.skip(r["skipped"])
        assert r["state"] == "captured", r["reason"]
        assert r["stats"]["replays"] >= 3 and r["stats"]["captures"] == 1
        assert r["losses_finite"] and r["params_moved"]


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_builds_and_captures(preset: str, results: dict[str, list[dict[str, Any]]]) -> None:
    _captures(results[f"preset_{preset.replace('-', '_')}"])


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_trains_as_eager_does(preset: str, results: dict[str, list[dict[str, Any]]]) -> None:
    # Bit for bit is the promise; a model whose eager run differs from itself (a kernel
    # that is not deterministic) may differ by as much as that. Where the model's library
    # takes another branch while a graph is recorded (transformers: an explicit causal
    # mask, another attention kernel), eager on that same branch must be equal, and plain
    # eager within that kernel's rounding. The sizes are reported.
    for r in ok(results[f"preset_{preset.replace('-', '_')}"]):
        if "skipped" in r:
            pytest.skip(r["skipped"])
        warnings.warn(
            f"{preset}: captured against eager {r['param_rel_diff']:.2e} "
            f"(eager against itself {r['control_rel_diff']:.2e}); against eager "
            f"on the recording's library branch {r['library_path_rel_diff']:.2e} "
            f"(that branch against itself {r['library_path_control_rel_diff']:.2e})",
            stacklevel=1,
        )
        as_eager = r["param_rel_diff"] <= max(1e-5, 2 * r["control_rel_diff"])
        as_branch = r["library_path_rel_diff"] <= max(1e-5, 2 * r["library_path_control_rel_diff"])
        assert as_eager or as_branch, r
        assert r["param_rel_diff"] <= KERNEL_ROUNDING_TOL, r


def test_fused_adamw_captures(results: dict[str, list[dict[str, Any]]]) -> None:
    _captures(results["fused_adamw"])


def test_compile_switch_captures_and_trains_like_the_compiled_model(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    for r in ok(results["compile_switch"]):
        assert r["strategy"] == "compile"
        assert r["state"] == "captured", r["reason"]
        assert r["stats"]["replays"] > 0 and r["stats"]["captures"] == 1
        assert not r["compiled_after_close"]  # the model is the user's again
        assert r["loss_rel_diff"] <= COMPILED_TOL and r["param_rel_diff"] <= COMPILED_TOL, r


def _ran(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if any("skipped" in r for r in ok(ranks)):
        pytest.skip(ok(ranks)[0]["skipped"])
    return ok(ranks)


def test_parity_check_names_the_llama_capture_branch(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    # The Llama's mask builder synchronises in eager steps and not while recording: the
    # capture reports that on rank 0, and a bit-for-bit parity check finds the difference,
    # names that line as the likely cause, and the step goes on eagerly (on_failure).
    for r in _ran(results["parity_llama_exact"]):
        warnings.warn(f"hf-llama, parity=True: {r['reason']}", stacklevel=1)
        assert r["state"] == "eager", r
        assert "PARITY_MISMATCH" in r["reason"] and "likely cause" in r["reason"], r["reason"]
        assert "masking_utils" in r["reason"], r["reason"]
        if r["rank"] == 0:
            assert any("masking_utils" in m and "parity=" in m for m in r["warnings"]), r[
                "warnings"
            ]
        # The check's one replay (its state undone), then eager steps only (run 33).
        assert r["stats"]["replays"] == 1 and r["stats"]["eager_steps"] >= 1, r["stats"]


def test_parity_check_accepts_the_llama_within_a_stated_tolerance(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    for r in _ran(results["parity_llama_tolerant"]):
        assert r["state"] == "captured" and r["reason"] is None, r
        assert r["stats"]["replays"] >= 3


def test_parity_check_passes_bit_for_bit_on_gpt2(results: dict[str, list[dict[str, Any]]]) -> None:
    # transformers synchronises in GPT-2's eager steps too (so the capture warns that the
    # graph may compute that part another way); the check measures it equal.
    for r in _ran(results["parity_gpt2_exact"]):
        warnings.warn(f"hf-gpt2, parity=True: warnings {r['warnings']}", stacklevel=1)
        assert r["state"] == "captured" and r["reason"] is None, r
        assert r["stats"]["replays"] >= 3
