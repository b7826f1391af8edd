"""Families of graphs across 2 and 4 gloo processes whose batch shapes differ on the same
call (tests/scenarios/cpu_family.py): training equals eager bit for bit on every rank,
and nothing hangs, with the stand-in and with the recording backend (whose replays run
no Python and replay the recorded collectives)."""

from __future__ import annotations

from typing import Any

import pytest

from launcher import ok
from shared_launches import batched
from variants import both_backends, key

pytestmark = pytest.mark.multiprocess

SCRIPT = "cpu_family.py"
SCENARIOS = [
    "shapes_differ_every_call",
    "shapes_differ_agree_every_4",
    "shapes_differ_with_eviction",
    "added_graph_fails_on_one_rank",
]
Results = dict[str, list[dict[str, Any]]]


# Run in one launch with the other modules' scenarios of the same world size (launcher.batched).
LAUNCHES = {n: batched(SCRIPT, both_backends(SCENARIOS), nproc=n, timeout=400) for n in (2, 4)}


@pytest.fixture(scope="module", params=[2, 4], ids=["2proc", "4proc"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Results:
    return LAUNCHES[int(request.param)].results(tmp_path_factory)


def _equal_to_eager(ranks: list[dict[str, Any]]) -> None:
    assert len({tuple(r["sizes"]) for r in ranks}) == len(ranks)  # the ranks' shapes differ
    for r in ranks:
        assert r["loss_rel_diff"] == 0.0 and r["param_rel_diff"] == 0.0, r
        assert r["states"] == ["warmup"] * 11 + ["captured"] * (len(r["states"]) - 11), r


def test_ranks_with_different_shapes_train_as_eager(results: Results, variant: str) -> None:
    ranks = ok(results[key("shapes_differ_every_call", variant)])
    _equal_to_eager(ranks)
    for r in ranks:
        s = r["stats"]
        assert s["graphs"] == len(set(r["sizes"])) and s["captures"] == s["graphs"], s
        assert r["warnings"] == []


def test_graphs_are_added_only_on_decision_points(results: Results, variant: str) -> None:
    ranks = ok(results[key("shapes_differ_agree_every_4", variant)])
    _equal_to_eager(ranks)
    for r in ranks:
        assert 1 <= r["stats"]["graphs"] <= 3


def test_eviction_on_every_rank_keeps_training_equal(results: Results, variant: str) -> None:
    ranks = ok(results[key("shapes_differ_with_eviction", variant)])
    _equal_to_eager(ranks)
    for r in ranks:
        s = r["stats"]
        assert s["graphs"] == 2 and s["evictions"] >= 1 and s["captures"] == 2 + s["evictions"], s


def test_a_failed_added_graph_stays_on_its_rank(results: Results, variant: str) -> None:
    ranks = ok(results[key("added_graph_fails_on_one_rank", variant)])
    _equal_to_eager(ranks)
    last = len(ranks) - 1
    for r in ranks:
        graphs = r["stats"]["graphs"]
        assert graphs == (1 if r["rank"] == last else len(set(r["sizes"]))), r
    assert any(
        "injected failure of an added graph" in w and f"only on rank {last}" in w
        for w in ranks[0]["warnings"]
    )
