"""The parity check and checkpoint loads across 2 and 4 processes (torchrun + gloo on CPU,
stand-in backend): a mismatch seen by one rank is answered on every rank at the same
call, and a checkpoint of another structure is captured again by every rank together."""

from __future__ import annotations

from typing import Any

import pytest

from launcher import ok
from shared_launches import batched

pytestmark = pytest.mark.multiprocess

NAMES = ["parity_mismatch_on_one_rank", "parity_passes", "checkpoint_of_another_structure"]
Results = dict[str, list[dict[str, Any]]]


# Run in one launch with the other modules' scenarios of the same world size (launcher.batched).
LAUNCHES = {n: batched("cpu_optim.py", NAMES, nproc=n, timeout=300) for n in (2, 4)}


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Results:
    return LAUNCHES[int(request.param)].results(tmp_path_factory)


def test_a_parity_mismatch_on_one_rank_gives_the_graph_up_on_every_rank(results: Results) -> None:
    ranks = ok(results["parity_mismatch_on_one_rank"])
    for r in ranks:
        assert r["states"] == ["warmup"] * 11 + ["eager"] * 5, r
        assert r["code"] == "PARITY_MISMATCH" and r["finding_ranks"] == [[1]], r
        assert r["param_rel_diff"] == 0, r  # the check's replay undone: eager training
    assert len({r["param_sum"] for r in ranks}) == 1  # DDP keeps the ranks together


def test_a_passing_parity_check_keeps_every_rank_captured(results: Results) -> None:
    for r in ok(results["parity_passes"]):
        assert r["states"] == ["warmup"] * 11 + ["captured"] * 5 and r["code"] is None, r
        assert r["param_rel_diff"] == 0, r


def test_a_checkpoint_of_another_structure_is_captured_again_on_every_rank(
    results: Results,
) -> None:
    ranks = ok(results["checkpoint_of_another_structure"])
    for r in ranks:
        assert r["states"] == ["warmup"] * 11 + ["captured"] * 2 + ["warmup"] + ["captured"] * 2, r
        assert r["captures"] == 2 and r["code"] is None and r["param_rel_diff"] == 0, r
