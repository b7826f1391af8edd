"""`ddpgraph bench` arguments: checked before any worker starts."""

from __future__ import annotations

import pytest
import torch

from bench_args import parse
from bench_args import plan as _plan
from ddpgraph.bench import command, registered


def test_defaults_make_the_published_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plan = _plan(parse())
    assert plan.note is None
    assert [m.name for m in plan.models] == ["gpt", "resnet18"]
    assert plan.batch_sizes == {"gpt": [8, 32], "resnet18": [32, 128]}
    assert plan.strategies == [s for s in registered() if s.available]
    s = plan.settings
    assert (s.steps, s.warmup, s.window, s.timed_steps) == (60, 20, 10, 60)
    assert s.dataloader and s.profile_steps == 5
    assert plan.amp == "bf16"


def test_without_cuda_the_defaults_are_cpu_sized_and_say_so() -> None:
    plan = _plan(parse())  # this machine has no GPU, or --cpu below
    if torch.cuda.is_available():
        plan = _plan(parse("--cpu"))
    assert plan.batch_sizes == {"gpt": [4, 16], "mlp": [16, 64]}
    gpt = plan.models[0].workload.build()
    assert sum(p.numel() for p in gpt.parameters()) < 200_000  # the GPU default: ~11M
    assert plan.note is not None and plan.note.startswith("No CUDA here: CPU-sized default models")
    # A model named on the command line is taken as it is.
    chosen = _plan(parse("--cpu", "--model", "resnet18"))
    assert chosen.batch_sizes == {"resnet18": [32, 128]} and chosen.note is None


def test_minutes_of_work_on_cpu_are_said_before_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    args = parse("--cpu", "--nproc", "64", "--model", "hf-gpt2")
    said = command.slow_runs(_plan(args), args)
    assert len(said) == 2, said
    assert said[0].startswith("--nproc 64 starts 64 CPU processes on 2 cores")
    assert said[1].startswith("hf-gpt2 is a GPU-sized model and there is no GPU here")
    quiet = parse("--cpu", "--nproc", "2")
    assert command.slow_runs(_plan(quiet), quiet) == []


def test_arguments_reach_the_plan() -> None:
    plan = _plan(
        parse(
            "--model",
            "mlp",
            "--batch-sizes",
            "4,16",
            "--strategies",
            "whole,eager",
            "--steps",
            "24",
            "--warmup",
            "12",
            "--no-data-loader",
            "--amp",
            "off",
            "--profile-steps",
            "0",
        )
    )
    assert plan.batch_sizes == {"mlp": [4, 16]}
    assert [s.name for s in plan.strategies] == ["eager", "whole"]
    assert (plan.settings.steps, plan.settings.window, plan.settings.warmup) == (24, 10, 12)
    assert not plan.settings.dataloader and plan.settings.profile_steps == 0
    assert plan.amp == "off"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--warmup", "5"], "[INVALID_ARGUMENT] `--warmup`: expected at least 12, got 5"),
        (["--steps", "0"], "[INVALID_ARGUMENT] `--steps`: expected at least 1, got 0"),
        (["--strategies", "eager,turbo"], "got 'turbo'"),
        (["--model", "bert"], "[INVALID_ARGUMENT] `--model`: expected one of gpt, mlp, resnet18"),
        (["--model", ","], "expected at least one model, got none"),
        (["--batch-sizes", "gpt=eight"], "[INVALID_ARGUMENT] `--batch-sizes`"),
    ],
)
def test_bad_arguments_exit_2_with_the_finding(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert command.main(parse(*argv), argv) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert "HINT:" in err


def test_list_strategies(capsys: pytest.CaptureFixture[str]) -> None:
    assert command.main(parse("--list-strategies"), ["--list-strategies"]) == 0
    out = capsys.readouterr().out
    for name in (
        "eager",
        "torch-compile",
        "reduce-overhead",
        "recipe",
        "whole",
        "compile",
        "partial",
    ):
        assert name in out
