"""The results as data (schema), compared (speedups, summary), and shown (tables, plot)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from ddpgraph.bench.compare import fill_speedups, summary
from ddpgraph.bench.plot import plot_speedups, speedup_figure
from ddpgraph.bench.schema import SCHEMA_VERSION, FeedResult, Report, StrategyResult, validate
from ddpgraph.bench.table import markdown, result_row, summary_row
from ddpgraph.bench.terminal import terminal_tables
from ddpgraph.bench.worker import payload
from ddpgraph.errors import DdpGraphUsageError

SETUP: dict[str, Any] = {
    "world_size": 2,
    "backend": "nccl",
    "device": "NVIDIA H200",
    "torch": "2.11.0",
    "cuda": "13.0",
    "nccl": "2.28.9",
    "python": "3.12.0",
    "ddpgraph": "0.1.0",
    "command": "ddpgraph bench --model gpt",
    "date": "2026-11-30T10:00:00+00:00",
    "settings": {"amp": "bf16"},
}


def _ok(strategy: str, ms: float, loader_ms: float, **kw: Any) -> StrategyResult:
    feeds = {
        "device": FeedResult(ms, 0.2, [ms] * 3),
        "dataloader": FeedResult(loader_ms, 0.4, [loader_ms] * 3),
    }
    return StrategyResult("gpt", kw.pop("batch_size", 8), strategy, feeds=feeds, **kw)


def sample_report() -> Report:
    results = [
        _ok("eager", 14.4, 15.0, peak_memory_mib=900.0, final_loss=2.5),
        _ok("reduce-overhead", 7.0, 7.5),
        _ok("recipe", 4.5, 4.8, capture_s=0.03, captured=True, kernel_ms_per_step=4.5),
        _ok("whole", 4.6, 4.8, capture_s=0.04, captured=True, kernel_ms_per_step=4.6),
        _ok("compile", 4.0, 4.3, capture_s=0.05, captured=True),
        StrategyResult(
            "gpt",
            8,
            "torch-compile",
            status="failed",
            reason="failed during warm-up (ranks 0-1: RuntimeError: boom)",
        ),
        StrategyResult("gpt", 8, "partial", status="skipped", reason="not available yet"),
        _ok("eager", 18.7, 19.0, batch_size=32),
        _ok(
            "whole",
            10.2,
            10.5,
            batch_size=32,
            captured=False,
            note="ran eagerly: [HOST_SYNC_IN_CAPTURE] x",
        ),
    ]
    for r in results:
        if r.kernel_ms_per_step:
            for f in r.feeds.values():
                f.gpu_busy = r.kernel_ms_per_step / f.ms_per_step
    return Report(SETUP, [{"name": "eager"}], results)


def test_speedups_are_over_eager_with_the_same_feed() -> None:
    report = sample_report()
    fill_speedups(report)
    cap = report.case("gpt", 8)["whole"]
    assert cap.feeds["device"].speedup == pytest.approx(14.4 / 4.6)
    assert cap.feeds["dataloader"].speedup == pytest.approx(15.0 / 4.8)
    assert report.case("gpt", 8)["eager"].feeds["device"].speedup == pytest.approx(1.0)
    assert report.case("gpt", 32)["whole"].feeds["device"].speedup == pytest.approx(18.7 / 10.2)


def test_summary_relates_whole_to_every_alternative() -> None:
    report = sample_report()
    fill_speedups(report)
    rows = summary(report)
    assert [(r["model"], r["batch_size"]) for r in rows] == [("gpt", 8), ("gpt", 32)]
    b8 = rows[0]
    assert b8["speedup_vs_eager"] == pytest.approx(14.4 / 4.6)
    assert b8["speedup_vs_reduce_overhead"] == pytest.approx(7.0 / 4.6)
    assert b8["overhead_vs_recipe_percent"] == pytest.approx((4.6 / 4.5 - 1) * 100)
    assert b8["compile_speedup"] == pytest.approx(4.6 / 4.0)
    assert b8["gpu_busy"] == pytest.approx(1.0)
    assert b8["dataloader_gpu_busy"] == pytest.approx(4.6 / 4.8)
    assert summary_row(b8)[:3] == ["gpt", "8", "yes"]
    assert summary_row(b8)[3:6] == ["3.13×", "1.52×", "+2.2%"]
    b32 = rows[1]
    assert b32["captured"] is False
    assert summary_row(b32)[2] == "no"
    assert b32["speedup_vs_reduce_overhead"] is None and b32["overhead_vs_recipe_percent"] is None


def test_payload_validates_and_round_trips_through_json() -> None:
    data = json.loads(json.dumps(payload(sample_report())))
    assert validate(data) == []
    assert data["schema_version"] == SCHEMA_VERSION
    again = Report.from_dict(data)
    assert again.results == Report.from_dict(data).results
    assert again.case("gpt", 8)["whole"].feeds["device"].ms_per_step == 4.6
    assert "| 8 | whole | 4.60 ± 0.10 | 3.13× |" in data["markdown"]


@pytest.mark.parametrize("version", [1, 2, 4])
def test_a_file_of_another_schema_version_is_refused_naming_both_versions(version: int) -> None:
    data = json.loads(json.dumps(payload(sample_report())))
    data["schema_version"] = version
    with pytest.raises(
        DdpGraphUsageError, match=f"schema_version {version}, expected {SCHEMA_VERSION}"
    ):
        Report.from_dict(data)


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda d: d.update(schema_version=99), "schema_version is 99"),
        (lambda d: d["setup"].pop("nccl"), "setup.nccl is missing"),
        (lambda d: d["results"][0].update(status="great"), "results[0].status is 'great'"),
        (lambda d: d["results"][5].update(reason=None), "results[5] is failed without a reason"),
        (
            lambda d: d["results"][0]["feeds"]["device"].pop("ms_per_step"),
            "results[0].feeds.device.ms_per_step is missing",
        ),
        (lambda d: d["results"][0].update(batch_size="8"), "results[0].batch_size has type str"),
        (lambda d: d["results"][0].update(batch_size=True), "results[0].batch_size is a bool"),
        (lambda d: d.pop("markdown"), "markdown is missing"),
        (
            lambda d: d["results"][0].update(gpu_timeline=[1.0]),
            "results[0].gpu_timeline has type list",
        ),
    ],
)
def test_validate_names_what_is_wrong(edit: Any, problem: str) -> None:
    data = copy.deepcopy(payload(sample_report()))
    edit(data)
    assert any(problem in p for p in validate(data)), validate(data)
    # Another schema version is refused by its own message (naming both versions).
    with pytest.raises(
        ValueError, match=r"not a ddpgraph bench result|schema_version 99, expected 3"
    ):
        Report.from_dict(data)


def test_result_row_cells() -> None:
    report = sample_report()
    fill_speedups(report)
    case = report.case("gpt", 8)
    assert result_row(case["whole"]) == [
        "8",
        "whole",
        "4.60 ± 0.10",
        "3.13×",
        "100%",
        "–",  # no throughput: the sample results have no unit
        "40 ms",
        "–",
        "4.80 ± 0.20",
        "3.12×",
        "96%",
        "",
    ]
    failed = result_row(case["torch-compile"])
    assert failed[2] == "failed" and failed[-1].startswith("failed during warm-up")
    assert result_row(case["partial"])[2] == "skipped"
    assert result_row(report.case("gpt", 32)["whole"])[6] == "not captured"


def test_rich_tables_show_every_strategy_and_the_summary() -> None:
    report = sample_report()
    fill_speedups(report)
    console = Console(record=True, width=250, markup=False)
    for table in terminal_tables(report, summary(report)):
        console.print(table)
    text = console.export_text()
    assert "gpt: 2 × NVIDIA H200, torch 2.11.0, bf16 autocast" in text
    for name in ("eager", "reduce-overhead", "recipe", "compile", "partial"):
        assert name in text
    assert "whole against the others" in text
    assert "whole = capture_step; compile = capture_step(compile=True)" in text
    assert "+2.2%" in text  # whole vs recipe at batch 8
    assert "RuntimeError: boom" in text


def test_markdown_escapes_cells() -> None:
    report = sample_report()
    report.results[0].note = "a | b\nc"
    text = markdown(report, [])
    assert "a \\| b; c" in text
    assert "whole (capture_step) against the alternatives" not in text


def test_plot_draws_a_panel_per_model(tmp_path: Path) -> None:
    report = sample_report()
    fill_speedups(report)
    path = tmp_path / "speedup.png"
    assert plot_speedups(report, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_has_one_legend_below_the_panels_naming_what_ran() -> None:
    report = sample_report()
    fill_speedups(report)
    figure, drew = speedup_figure(report)
    assert figure is not None and drew
    panels = [ax for ax in figure.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == report.models
    assert all(ax.get_legend() is None for ax in panels)  # a legend inside covers the lines
    [legend] = figure.legends
    labels = [t.get_text() for t in legend.get_texts()]
    ran = {r.strategy for r in report.results if r.status == "ok" and r.strategy != "eager"}
    assert ran <= set(labels)
    assert {"eager DDP (1×)", "batches already on the GPU", "fed by a DataLoader"} <= set(labels)


def test_plot_without_speedups_says_so(tmp_path: Path) -> None:
    report = Report(SETUP, [], [StrategyResult("gpt", 8, "eager", status="failed", reason="x")])
    fill_speedups(report)
    assert not plot_speedups(report, str(tmp_path / "empty.png"))
    assert not plot_speedups(Report(SETUP, [], []), str(tmp_path / "none.png"))


DATA = Path(__file__).parent / "data"
# Written by `ddpgraph bench --cpu --model mlp --batch-sizes 8 --strategies
# eager,capture_step,compile,capture_step+compile,recipe` before the names were make_step's.
OLD_FILE = DATA / "bench_v2.json"


def test_a_file_of_the_old_names_is_refused_not_renamed() -> None:
    data = json.loads(OLD_FILE.read_text())
    assert data["schema_version"] == 2
    with pytest.raises(DdpGraphUsageError) as info:
        Report.from_dict(data)
    assert "schema_version 2, expected 3" in str(info.value)
    assert "run `ddpgraph bench` again" in str(info.value)


def test_a_file_of_the_current_version_keeps_its_names() -> None:
    data = json.loads(json.dumps(payload(sample_report())))
    assert data["schema_version"] == SCHEMA_VERSION == 3
    names = [r["strategy"] for r in data["results"]]
    assert "compile" in names and "torch-compile" in names
    assert [r.strategy for r in Report.from_dict(data).results] == names


def test_the_published_results_load_under_make_steps_names() -> None:
    data = json.loads((Path(__file__).resolve().parents[2] / "docs" / "bench.json").read_text())
    report = Report.from_dict(data)
    every = {"eager", "torch-compile", "reduce-overhead", "recipe", "whole", "compile", "partial"}
    assert {r.strategy for r in report.results} == every
    fill_speedups(report)
    [row] = [r for r in summary(report) if (r["model"], r["batch_size"]) == ("gpt", 8)]
    # The summary of its rows is the one published with the file.
    assert row["compile_speedup"] == pytest.approx(data["summary"][0]["compile_speedup"])
    assert row["speedup_vs_eager"] == pytest.approx(data["summary"][0]["speedup_vs_eager"])


def cpu_report() -> Report:
    """A run without CUDA: `whole` captured with the CPU recording backend."""
    setup = {
        **SETUP,
        "backend": "gloo",
        "device": "x86_64",
        "cuda": None,
        "nccl": None,
        "settings": {"amp": "off"},
    }
    results = [
        _ok("eager", 20.0, 10.0),
        _ok("whole", 15.0, 14.0, capture_s=0.05, captured=True, note="CPU emulation: ..."),
        StrategyResult("gpt", 8, "recipe", status="skipped", reason="needs CUDA"),
    ]
    return Report(setup, [{"name": "eager"}], results)


def test_a_cpu_run_says_in_rows_summary_and_plot_that_its_captures_are_emulated(
    tmp_path: Path,
) -> None:
    report = cpu_report()
    fill_speedups(report)
    data = payload(report)
    assert report.emulated and not sample_report().emulated
    whole = result_row(report.case("gpt", 8)["whole"], report.emulated)
    assert whole[3] == "1.33× emulated" and whole[9] == "0.71× emulated"
    [row] = data["summary"]
    assert summary_row(row, report.emulated)[2:4] == ["emulated", "1.33× emulated"]
    console = Console(width=200, record=True)
    for part in terminal_tables(report, data["summary"]):
        console.print(part)
    text = console.export_text()
    assert "emulated: without CUDA the capture is emulated on CPU" in text and " yes " not in text
    assert "emulated" in data["markdown"] and "it is not a GPU speed-up" in data["markdown"]
    figure, drew = speedup_figure(report)
    assert figure is not None and not drew  # no speed-up line drawn from CPU times
    assert not plot_speedups(report, str(tmp_path / "cpu.png")) and (tmp_path / "cpu.png").exists()
