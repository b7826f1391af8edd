"""Throughput beside ms/step: units per second over all ranks, in the JSON and the table."""

from __future__ import annotations

from ddpgraph.app.models import BUILTIN_WORKLOADS
from ddpgraph.bench.schema import FeedResult, Report, StrategyResult, validate
from ddpgraph.bench.table import RESULT_HEADERS, result_row
from ddpgraph.bench.throughput import fill_throughput, si, throughput_cell


def _result(ms: float = 4.0) -> StrategyResult:
    result = StrategyResult("gpt", 8, "whole")
    result.feeds = {"device": FeedResult(ms, 0.1), "dataloader": FeedResult(2 * ms, 0.1)}
    return result


def test_units_per_second_of_each_feed() -> None:
    result = _result()
    fill_throughput(result, "tokens", 2 * 8 * 128)  # 2 ranks × batch 8 × 128 tokens
    assert (result.throughput_unit, result.units_per_step) == ("tokens", 2048)
    assert result.feeds["device"].throughput == 2048 / 0.004
    assert result.feeds["dataloader"].throughput == 2048 / 0.008


def test_the_table_shows_it_beside_ms_per_step() -> None:
    result = _result()
    fill_throughput(result, "images", 64)
    row = dict(zip(RESULT_HEADERS, result_row(result), strict=True))
    assert row["throughput"] == "16k images/s"
    assert throughput_cell(StrategyResult("gpt", 8, "eager", status="skipped", reason="no")) == "–"


def test_si_prefixes() -> None:
    assert [si(v) for v in (980.0, 16_000.0, 1_254_000.0, 3.2e9)] == ["980", "16k", "1.25M", "3.2G"]


def test_built_in_workloads_say_what_a_sample_holds() -> None:
    units = {n: (w().unit, w().per_sample) for n, w in BUILTIN_WORKLOADS.items()}
    assert units == {"gpt": ("tokens", 128), "mlp": ("samples", 1), "resnet18": ("images", 1)}


def test_results_with_and_without_throughput_validate() -> None:
    result = _result()
    fill_throughput(result, "tokens", 1024)
    report = Report({}, [], [result])
    data = report.to_dict(summary=[], markdown="")
    assert not [p for p in validate(data) if "results" in p]
    for key in ("throughput_unit", "units_per_step"):
        del data["results"][0][key]  # written before the field existed
    for feed in data["results"][0]["feeds"].values():
        del feed["throughput"]
    assert not [p for p in validate(data) if "results" in p]
    assert StrategyResult.from_dict(data["results"][0]).throughput_unit is None
