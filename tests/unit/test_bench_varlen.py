"""`ddpgraph bench --seq-lens`: its arguments, its per-step lengths, its results as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bench_args import parse
from bench_args import plan as _plan
from ddpgraph.bench import command, varlen_rows, worker
from ddpgraph.bench.schema import FeedResult, Report, StrategyResult, validate
from ddpgraph.bench.varlen_data import padded, step_lengths, varlen_batches
from ddpgraph.bench.varlen_plan import FAMILIES, MIN_WARMUP, VarLen, default_buckets
from ddpgraph.bench.varlen_report import plot_varlen, varlen_markdown, varlen_summary
from ddpgraph.ddp.distributed import DistInfo
from ddpgraph.family.buckets import next_bucket


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--seq-lens", "512:64"],
            "`--seq-lens`: expected LOW:HIGH with 1 <= LOW < HIGH, got '512:64'",
        ),
        (["--seq-lens", "512"], "expected LOW:HIGH"),
        (["--seq-lens", "0:64"], "expected LOW:HIGH"),
        (["--seq-lens", "a:b"], "expected LOW:HIGH"),
        (["--buckets", "64,128"], "`--buckets`: expected it with `--seq-lens`"),
        (
            ["--seq-lens", "64:512", "--buckets", "64,128,256"],
            "expected the largest bucket to hold the longest length 512",
        ),
        (
            ["--seq-lens", "64:512", "--buckets", "32,512"],
            "bucket(s) 32 are shorter than every length",
        ),
        (["--seq-lens", "64:512", "--buckets", "x"], "expected positive lengths"),
        (
            ["--seq-lens", "64:512", "--model", "resnet18"],
            "`--seq-lens` with `--model resnet18`: expected a sequence workload "
            "(batches of tokens), got one of images",
        ),
        (["--seq-lens", "64:512", "--model", "mlp"], "got one of samples"),
        (
            ["--seq-lens", "64:512", "--strategies", "eager,recipe"],
            "`--strategies` with `--seq-lens`: expected names from eager, "
            "reduce-overhead, whole, compile, got 'recipe'",
        ),
    ],
)
def test_bad_arguments_exit_2_with_the_finding(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert command.main(parse(*argv), argv) == 2
    err = capsys.readouterr().err
    assert "[INVALID_ARGUMENT]" in err and expected in err
    assert "HINT:" in err


def test_a_factory_with_short_sequences_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    factory = tmp_path / "short_lm.py"
    factory.write_text(
        "from ddpgraph.app.models import CPU_GPT_CONFIG, gpt_workload\n"
        "def make():\n"
        "    w = gpt_workload(CPU_GPT_CONFIG)\n"
        "    w.name = 'short'\n"
        "    return w\n"
    )
    argv = ["--seq-lens", "8:64", "--model", f"{factory}:make"]
    assert command.main(parse(*argv), argv) == 2
    assert (
        "the factory's batches have 32 tokens per sequence, fewer than the longest length 64"
        in capsys.readouterr().err
    )


def test_default_buckets_are_the_quartiles_of_the_range_the_lengths_come_from() -> None:
    assert default_buckets(64, 512) == (176, 288, 400, 512)
    assert default_buckets(100, 1000) == (328, 552, 776, 1000)
    assert default_buckets(500, 512) == (504, 512)
    assert default_buckets(8, 32) == (16, 24, 32)
    assert default_buckets(8, 12) == (12,)  # rounded up to 8's multiple, but never past HIGH


def test_default_buckets_pad_less_than_the_longest_and_its_halves() -> None:
    # The lengths are drawn uniformly: what a GPU-bound step pays is the mean padded length.
    def mean_padded(buckets: tuple[int, ...], low: int, high: int) -> float:
        return sum(next_bucket(n, buckets) for n in range(low, high + 1)) / (high - low + 1)

    for low, high in [(64, 512), (100, 1000), (128, 2048)]:
        ours = mean_padded(default_buckets(low, high), low, high)
        halves = mean_padded(
            tuple(b for b in (high // 8, high // 4, high // 2, high) if b >= low), low, high
        )
        assert ours < halves and ours - (low + high) / 2 <= (high - low) / 8 + 8, (
            low,
            high,
            ours,
            halves,
        )


def test_the_plan_of_a_variable_length_run() -> None:
    plan = _plan(parse("--cpu", "--seq-lens", "8:48", "--strategies", "whole,eager"))
    assert plan.varlen == VarLen(8, 48, (24, 32, 40, 48), ("eager", "whole"))
    assert [m.name for m in plan.models] == ["gpt"] and plan.batch_sizes == {"gpt": [4]}
    # The CPU-sized gpt, built again to hold the longest length.
    assert plan.models[0].workload.per_sample == 48
    gpt = plan.models[0].workload.build()
    assert gpt(torch.zeros(2, 48, dtype=torch.long)).shape[:2] == (2, 48)
    assert plan.note is not None and "No CUDA here" in plan.note
    assert [s.name for s in plan.strategies] == ["eager", "reduce-overhead"]
    # Timed on the device feed only, after a warm-up long enough for each bucket's capture.
    assert plan.settings.warmup == MIN_WARMUP and not plan.settings.dataloader
    assert _plan(parse("--cpu", "--seq-lens", "8:48")).varlen.families == FAMILIES  # type: ignore[union-attr]


def test_step_lengths_are_seeded_in_range_and_per_rank() -> None:
    varlen = VarLen(64, 512, (64, 128, 256, 512))
    first = step_lengths(varlen, 200, rank=0)
    assert first == step_lengths(varlen, 200, rank=0)
    assert first != step_lengths(varlen, 200, rank=1)
    assert min(first) >= 64 and max(first) <= 512 and len(set(first)) > 50


def test_every_row_trains_on_the_same_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan(parse("--cpu", "--seq-lens", "8:32", "--warmup", "12"))
    seen: dict[str, list[int]] = {}

    def fake_run(
        strategy: Any, case: Any, batches: list[Any], settings: Any, control: Any, **kw: Any
    ) -> StrategyResult:
        assert settings.warmup == MIN_WARMUP and not settings.dataloader
        seen[strategy.name] = [int((y != -100).sum()) // case.batch_size for _, y in batches]
        seen[strategy.name + " shape"] = [x.shape[1] for x, _ in batches]
        return StrategyResult(
            case.workload.name, case.batch_size, strategy.name, status="skipped", reason="test"
        )

    monkeypatch.setattr(varlen_rows, "run_strategy", fake_run)
    info = DistInfo(0, 1, 0, torch.device("cpu"), "gloo")
    results = varlen_rows.run_varlen(info, plan)
    lengths = step_lengths(plan.varlen, MIN_WARMUP, 0)  # type: ignore[arg-type]
    for name in ("eager", "reduce-overhead", "reduce-overhead dynamic=True", "whole"):
        assert seen[name] == lengths and seen[name + " shape"] == lengths
    for name in ("whole+buckets", "compile+buckets"):
        assert seen[name] == lengths  # the real tokens: the same lengths
        assert seen[name + " shape"] == [next_bucket(t, plan.varlen.buckets) for t in lengths]
    assert set(seen["eager T=20 shape"]) == {20} and set(
        seen["whole+buckets T=32 alone shape"]
    ) == {32}
    assert [r.varlen["role"] for r in results if r.varlen] == ["variable"] * 4 + [
        "bucketed"
    ] * 2 + ["fixed"] * 2 + ["pool_reference"]


def test_padding_keeps_the_tokens_and_masks_the_labels() -> None:
    plan = _plan(parse("--cpu", "--seq-lens", "8:32"))
    cut = varlen_batches(plan.models[0], 4, [9, 17, 32], rank=0)
    assert [x.shape for x, _ in cut] == [(4, 9), (4, 17), (4, 32)]
    for (x, y), (px, py) in zip(cut, padded(cut, (16, 32)), strict=True):
        t = x.shape[1]
        assert torch.equal(px[:, :t], x) and torch.equal(py[:, :t], y)
        assert bool((py[:, t:] == -100).all()) and bool((px[:, t:] == 0).all())


SETUP: dict[str, Any] = {
    "world_size": 1,
    "backend": "nccl",
    "device": "NVIDIA H200",
    "torch": "2.11.0",
    "cuda": "13.0",
    "nccl": "2.28.9",
    "python": "3.12.0",
    "ddpgraph": "0.1.0",
    "command": "ddpgraph bench --seq-lens 64:512",
    "date": "2026-12-01T10:00:00+00:00",
    "settings": {
        "amp": "bf16",
        "variable_lengths": VarLen(64, 512, (64, 128, 256, 512)).describe(),
    },
}


def _row(name: str, ms: float, role: str, family: str, **varlen: Any) -> StrategyResult:
    result = StrategyResult("gpt", 8, name, feeds={"device": FeedResult(ms, 0.1, [ms] * 3)})
    result.varlen = {"role": role, "family": family, "lengths": "64:512", "buckets": None, **varlen}
    return result


def varlen_report(setup: dict[str, Any] = SETUP) -> Report:
    graphs = {
        "graphs_held": 4,
        "captures": 4,
        "replays": 50,
        "eager_steps": 15,
        "eager_after_warmup": 0,
    }
    return Report(
        setup,
        [],
        [
            _row("eager", 20.0, "variable", "eager"),
            _row("reduce-overhead", 9.0, "variable", "reduce-overhead"),
            _row(
                "whole",
                17.0,
                "variable",
                "whole",
                graphs_held=1,
                captures=1,
                eager_steps=90,
                eager_after_warmup=50,
            ),
            _row("whole+buckets", 4.0, "bucketed", "whole", pool_mib=932.0, **graphs),
            _row("compile+buckets", 3.0, "bucketed", "compile", pool_mib=900.0, **graphs),
            _row("eager T=288", 18.0, "fixed", "eager"),
            _row("whole T=288", 3.6, "fixed", "whole"),
            _row("whole+buckets T=512 alone", 4.5, "pool_reference", "whole", pool_mib=910.0),
        ],
    )


def test_summary_holds_the_three_targets() -> None:
    (row,) = varlen_summary(varlen_report())
    assert row["fixed_speedup"] == pytest.approx(20 / 3.6) and row[
        "bucketed_speedup"
    ] == pytest.approx(5.0)
    assert row["fixed_speedup_over_fixed_eager"] == pytest.approx(5.0)
    # Both speedups over the same variable-length eager run: 3.6 ms fixed against 4.0 bucketed.
    assert row["share_of_fixed_speedup"] == pytest.approx(0.9) and row["share_target_met"] is True
    assert row["share_against_fixed_eager"] == pytest.approx(1.0)
    # compile+buckets is the family's own variant, not an alternative it must beat.
    assert (
        row["best_other"] == {"row": "reduce-overhead", "ms_per_step": 9.0}
        and row["beats_all"] is True
    )
    assert row["pool_ratio"] == pytest.approx(932 / 910) and row["pool_target_met"] is True
    slow = varlen_report()
    slow.results[3].feeds[
        "device"
    ].ms_per_step = 10.0  # 3.6 against 10 ms: 36%, slower than reduce-overhead
    (row,) = varlen_summary(slow)
    assert row["share_target_met"] is False and row["beats_all"] is False
    # Without CUDA nothing is judged: the capture_step rows were emulated.
    (cpu,) = varlen_summary(varlen_report({**SETUP, "cuda": None}))
    assert (
        cpu["share_target_met"] is None
        and cpu["beats_all"] is None
        and cpu["pool_target_met"] is None
    )


def test_payload_validates_and_round_trips_through_json(tmp_path: Path) -> None:
    data = json.loads(json.dumps(worker.payload(varlen_report())))
    assert validate(data) == []
    again = Report.from_dict(data)
    assert [r.feeds["device"].ms_per_step for r in again.results] == [
        r.feeds["device"].ms_per_step for r in varlen_report().results
    ]
    assert [r.varlen for r in again.results] == [r.varlen for r in varlen_report().results]
    fixed = again.case("gpt", 8)["whole T=288"].feeds["device"]
    assert fixed.speedup == pytest.approx(5.0)  # over eager at that length, not the variable one
    assert data["summary"][0]["share_target_met"] is True
    assert (
        "whole+buckets against its targets" in data["markdown"]
        and "ignore_index" in data["markdown"]
    )
    # A file of the fixed-shape bench, from before the field existed, still loads.
    for result in data["results"]:
        del result["varlen"]
    assert Report.from_dict(data).results[0].varlen is None
    assert plot_varlen(varlen_report(), str(tmp_path / "varlen.png"))
    assert (tmp_path / "varlen.png").stat().st_size > 0
    assert (
        "| 8 | whole+buckets | 64:512 | 4.00 | 5.00× | 4 | 4 | 15 (0) | 932 |" in data["markdown"]
    )
    assert (
        "| gpt | 8 | 5.56× | 5.00× | 90% PASS | reduce-overhead 9.00 ms | PASS | 1.02× PASS |"
        in varlen_markdown(again, data["summary"])
    )


def test_presets_are_built_again_for_the_longest_length(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    plan = _plan(parse("--cpu", "--seq-lens", "64:512", "--model", "hf-gpt2,hf-llama"))
    assert [(m.name, m.workload.per_sample) for m in plan.models] == [
        ("hf-gpt2", 512),
        ("hf-llama", 512),
    ]
    x, y = plan.models[0].workload.make_batch(
        2, torch.Generator().manual_seed(0), torch.device("cpu")
    )
    assert x.shape == y.shape == (2, 512)
    argv = ["--seq-lens", "64:2048", "--model", "hf-gpt2"]
    assert command.main(parse(*argv), argv) == 2
    assert "expected lengths up to the model's 1024 positions, got 2048" in capsys.readouterr().err
