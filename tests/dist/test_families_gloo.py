"""Model families on gloo CPU processes with the recording backend
(tests/scenarios/families.py): each captured and equal bit for bit to the same training
run eagerly with the same graph-safe optimizer, or refused with the exact cause, on
every rank. SyncBatchNorm's statistics (all-gathered in forward, their gradients
all-reduced in backward) and the mixture of experts also at 4 ranks."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

from launcher import ok
from shared_launches import batched

pytestmark = pytest.mark.multiprocess
CAPTURED = ["bert", "moe", "moe_bf16", "syncbn", "ckpt", "ckpt_reentrant"]
# Where transformers reads a tensor on the host on the path it takes when no stream captures.
REFUSED = {
    "bert_as_called": "masking_utils.py",  # whether the padding mask is all ones (SDPA's shortcut)
    "moe_eager_experts": "modeling_mixtral.py",  # the per-expert loop over the routed tokens
}
Results = dict[str, list[dict[str, Any]]]


# Run in one launch with the other modules' scenarios of the same world size (launcher.batched).
LAUNCHES = {
    2: batched(
        "families.py", [f"recording:{n}" for n in [*CAPTURED, *REFUSED]], nproc=2, timeout=900
    ),
    4: batched("families.py", ["recording:syncbn", "recording:moe"], nproc=4, timeout=900),
}


def _launched(tmp_path_factory: pytest.TempPathFactory, nproc: int) -> Results:
    found = LAUNCHES[nproc].results(tmp_path_factory)
    return {name.split(":", 1)[1]: ranks for name, ranks in found.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    return _launched(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> Results:
    return _launched(tmp_path_factory, 4)


def _captured_like_eager(ranks: list[dict[str, Any]]) -> None:
    for r in ok(ranks):
        assert r["state"] == "captured" and r["code"] is None, r["reason"]
        assert r["stats"]["captures"] == 1 and r["stats"]["eager_steps"] == 0
        assert r["stats"]["replays"] == r["steps"] - r["stats"]["warmup_steps"] > 0
        assert r["same_losses"] and r["losses_finite"]
        assert r["param_rel_diff"] == 0.0 and r["buffer_rel_diff"] == 0.0


@pytest.mark.parametrize("name", CAPTURED)
def test_each_family_is_captured_and_trains_like_eager(results: Results, name: str) -> None:
    _captured_like_eager(results[name])


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_host_read_in_the_library_is_refused_with_its_line_on_every_rank(
    results: Results, name: str
) -> None:
    for r in ok(results[name]):
        assert r["state"] == "eager" and r["code"] == "HOST_SYNC_IN_CAPTURE", r["reason"]
        assert REFUSED[name] in r["reason"] and "[ranks 0-1]" in r["reason"]
        assert r["same_losses"] and r["param_rel_diff"] == 0.0


def test_the_per_expert_loop_names_transformers_fixed_shape_routing_as_the_fix(
    results: Results,
) -> None:
    for r in ok(results["moe_eager_experts"]):
        assert (
            'HINT: `MixtralExperts` routes tokens with `experts_implementation="eager"`'
            in r["reason"]
        )
        assert 'experts_implementation="grouped_mm"' in r["reason"]


def test_sync_batch_norm_shares_statistics_inside_the_graph(results: Results) -> None:
    for r in ok(results["syncbn"]):
        assert "c10d.allgather_.default" in r["collectives"]  # the statistics, in forward
        assert r["batch_norm_loss_diff"] > 0  # every rank's statistics count


def test_four_ranks(four_ranks: Results) -> None:
    _captured_like_eager(four_ranks["syncbn"])
    _captured_like_eager(four_ranks["moe"])
