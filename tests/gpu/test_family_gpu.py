"""`capture_step(max_graphs=4)` on GPUs (tests/scenarios/gpu_family.py): training over
bucketed variable lengths equals eager training, and the family's pool stays near the
memory of its largest graph. Runs at world size 1 (`DDPGRAPH_GPU_WORLD=1`) or 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from launcher import gpu_world, ok, run_scenarios

pytestmark = pytest.mark.gpu
TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("gpu_family")
    return run_scenarios(
        "gpu_family.py",
        ["varlen_equivalence", "pool_memory"],
        Path(out),
        nproc=gpu_world(),
        timeout=900,
    )


def test_bucketed_varlen_training_matches_eager(results: dict[str, list[dict[str, Any]]]) -> None:
    for r in ok(results["varlen_equivalence"]):
        s = r["stats"]
        assert r["state"] == "captured", r
        assert 2 <= s["graphs"] <= 4 and s["captures"] == s["graphs"] and s["replays"] > 30, s
        # Same kernels, same graph-safe optimizer, RNG from graphs registered with every
        # graph, a checkpoint loaded mid-run: expected bit for bit, promised to 1e-5.
        assert r["loss_rel_diff"] <= TOL and r["param_rel_diff"] <= TOL, r
        print(
            f"rank {r['rank']}: bitwise={r['bitwise']} graphs={s['graphs']} "
            f"replays={s['replays_per_graph']}"
        )


def test_family_pool_is_close_to_its_largest_graph(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    for r in ok(results["pool_memory"]):
        family, largest = r["family"], r["largest"]
        assert family["graphs"] == 4 and largest["graphs"] == 1, r
        assert family["pool_bytes"] and largest["pool_bytes"], r
        ratio = family["pool_bytes"] / largest["pool_bytes"]
        print(
            f"rank {r['rank']}: family pool {family['pool_bytes']} B, "
            f"largest graph {largest['pool_bytes']} B, ratio {ratio:.2f}"
        )
        assert ratio <= 1.3, r
