"""The bench's profiles leave no CUPTI subscription behind to slow later rows."""

from __future__ import annotations

import pytest

from ddpgraph.bench.busy import tear_down_cupti_after_profiles


@pytest.mark.parametrize("version", ["12.6", "12.8", "13.0", "13.1.2"])
def test_the_teardown_is_asked_for_where_cuda_graphs_survive_it(version: str) -> None:
    env: dict[str, str] = {}
    tear_down_cupti_after_profiles(version, env)
    assert env == {"TEARDOWN_CUPTI": "1"}


@pytest.mark.parametrize("version", [None, "11.8", "12.4", "odd"])
def test_no_teardown_below_cuda_12_6_or_without_cuda(version: str | None) -> None:
    env: dict[str, str] = {}
    tear_down_cupti_after_profiles(version, env)
    assert env == {}


def test_a_users_choice_is_kept() -> None:
    env = {"TEARDOWN_CUPTI": "0"}
    tear_down_cupti_after_profiles("13.0", env)
    assert env == {"TEARDOWN_CUPTI": "0"}
