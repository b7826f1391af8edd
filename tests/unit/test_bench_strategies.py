"""The strategy registry, and running strategies in one process (gloo, CPU)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpgraph
from ddpgraph.bench import (
    Case,
    Runner,
    Strategy,
    StrategyResult,
    register_strategy,
    registered,
    select,
)
from ddpgraph.bench import registry as registry_module
from ddpgraph.bench.control import Control, PhaseFailed, short_error
from ddpgraph.bench.feeds import host_batches
from ddpgraph.bench.measure import Settings, run_strategy
from ddpgraph.bench.workloads import resolve_model

MODELS = Path(__file__).parent.parent / "scenarios" / "bench_models.py"
BUILT_IN = ["eager", "torch-compile", "reduce-overhead", "recipe", "whole", "compile", "partial"]
QUICK = Settings(steps=4, warmup=12, window=2, profile_steps=0, dataloader=True, loader_workers=0)


@pytest.fixture
def own_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations in a test do not outlive it."""
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))


def test_built_in_strategies_in_order() -> None:
    assert [s.name for s in registered()] == BUILT_IN
    assert [s.name for s in select(None)] == BUILT_IN


def test_select_keeps_registry_order_and_rejects_unknown_names() -> None:
    assert [s.name for s in select(["whole", "eager"])] == ["eager", "whole"]
    with pytest.raises(ddpgraph.DdpGraphUsageError) as info:
        select(["eager", "cudagraphs", "fast"])
    text = str(info.value)
    assert text.startswith(
        "[INVALID_ARGUMENT] `--strategies`: expected names from eager, torch-compile"
    )
    assert "got 'cudagraphs', 'fast'" in text


def test_only_eager_strategies_run_on_cpu() -> None:
    runs_on_cpu = [s.name for s in registered() if s.skip_reason(on_cuda=False) is None]
    assert runs_on_cpu == ["eager", "whole"]
    runs_on_gpu = [s.name for s in registered() if s.skip_reason(on_cuda=True) is None]
    assert runs_on_gpu == BUILT_IN
    partial = registry_module._REGISTRY["partial"]
    assert (partial.skip_reason(on_cuda=False) or "").startswith("needs CUDA")


@pytest.mark.usefixtures("own_registry")
def test_register_strategy() -> None:
    def build(case: Case, model: nn.Module) -> Runner:
        raise NotImplementedError

    mine = register_strategy(Strategy("mine", "my way", build))
    assert registered()[-1] is mine and mine in select(None)
    with pytest.raises(
        ddpgraph.DdpGraphUsageError, match="a strategy named 'mine' is already registered"
    ):
        register_strategy(Strategy("mine", "again", build))
    register_strategy(Strategy("mine", "again", build), replace=True)
    assert registry_module._REGISTRY["mine"].summary == "again"
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="expected a `build` function"):
        register_strategy(Strategy("slot", "later", None))


def _case(factory: str = "tiny", batch_size: int = 4) -> Case:
    workload = resolve_model(f"{MODELS}:{factory}").workload
    return Case(workload, batch_size, torch.device("cpu"), None)


def _run(strategy: Strategy, case: Case, settings: Settings = QUICK) -> StrategyResult:
    batches = host_batches(case.workload, case.batch_size, rank=0)
    return run_strategy(strategy, case, batches, settings, Control(), profile_here=False)


@pytest.mark.usefixtures("process_group")
def test_eager_and_emulated_whole_train_alike_on_cpu() -> None:
    case = _case()
    eager = _run(registry_module._REGISTRY["eager"], case)
    captured = _run(registry_module._REGISTRY["whole"], case)
    for result in (eager, captured):
        assert result.status == "ok", result.reason
        assert set(result.feeds) == {"device", "dataloader"}
        assert len(result.feeds["device"].window_ms) == 2
        assert result.feeds["device"].ms_per_step > 0
        assert result.peak_memory_mib is None and result.kernel_ms_per_step is None
    # Same weights, same batches; on CPU `whole` (capture_step) emulates the capture with the fused
    # AdamW, which rounds differently from eager's default one.
    assert captured.final_loss == pytest.approx(eager.final_loss, rel=1e-5)
    assert captured.captured is True
    assert captured.note is not None and captured.note.startswith("CPU emulation")
    assert eager.note is None and eager.captured is None
    # Every timed call replayed, on either feed; eager captures nothing to count.
    assert [f.eager_calls for f in captured.feeds.values()] == [0, 0]
    assert [f.eager_calls for f in eager.feeds.values()] == [None, None]


class Recapturing(Runner):
    """Captured from the second device call; the DataLoader feed starts a new step that
    captures again only after `loader_calls_to_capture` calls; `eager_from` on, every
    call runs eagerly (a graph that serves no call)."""

    def __init__(
        self, device_calls: int, loader_calls_to_capture: int, eager_from: int | None = None
    ) -> None:
        self.calls = 0
        self.device_calls = device_calls
        self.to_capture = loader_calls_to_capture
        self.eager_from = eager_from
        self.eager = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.eager_from is not None and self.calls >= self.eager_from:
            self.eager += 1
        return torch.zeros(())

    @property
    def captured(self) -> bool:
        if self.calls <= self.device_calls:
            return self.calls >= 2
        return self.calls - self.device_calls >= self.to_capture

    @property
    def eager_calls(self) -> int:
        return self.eager


@pytest.mark.usefixtures("process_group")
def test_the_dataloader_warm_up_lasts_until_the_strategy_captured_again() -> None:
    device_calls = QUICK.warmup + QUICK.timed_steps
    runners: list[Recapturing] = []

    def build(case: Case, model: nn.Module) -> Runner:
        runners.append(Recapturing(device_calls, loader_calls_to_capture=QUICK.loader_warmup + 3))
        return runners[-1]

    result = _run(Strategy("recapturing", "captures again late", build), _case())
    assert result.status == "ok", result.reason
    # Two rounds of warm-up: the first ended before the second capture.
    assert runners[0].calls == device_calls + 2 * QUICK.loader_warmup + QUICK.timed_steps
    assert result.feeds["dataloader"].eager_calls == 0 and result.note is None


@pytest.mark.usefixtures("process_group")
def test_timed_calls_that_ran_eagerly_are_counted_and_said() -> None:
    device_calls = QUICK.warmup + QUICK.timed_steps
    eager_from = device_calls + QUICK.loader_warmup + 1  # every timed DataLoader call
    strategy = Strategy(
        "unserved", "eager calls", lambda case, model: Recapturing(device_calls, 1, eager_from)
    )
    result = _run(strategy, _case())
    assert result.feeds["device"].eager_calls == 0
    assert result.feeds["dataloader"].eager_calls == QUICK.timed_steps
    assert result.note == (
        f"{QUICK.timed_steps} of {QUICK.timed_steps} timed calls ran eagerly "
        "with the DataLoader feed"
    )


@pytest.mark.usefixtures("process_group")
def test_skipped_strategies_say_why() -> None:
    for name in ("torch-compile", "reduce-overhead", "recipe", "compile", "partial"):
        result = _run(registry_module._REGISTRY[name], _case())
        assert result.status == "skipped" and result.reason, name
        assert result.feeds == {}


@pytest.mark.usefixtures("process_group")
def test_a_failing_strategy_is_recorded_not_raised() -> None:
    result = _run(registry_module._REGISTRY["eager"], _case("broken"))
    assert result.status == "failed"
    assert (
        result.reason
        == "failed during warm-up (rank 0: RuntimeError: this model cannot run forward)"
    )
    assert result.wall_s is not None


@pytest.mark.usefixtures("process_group")
def test_runner_is_closed_even_after_a_failure() -> None:
    closed: list[bool] = []

    class Failing(Runner):
        def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

        def close(self) -> None:
            closed.append(True)

    strategy = Strategy("failing", "fails", lambda case, model: Failing())
    result = _run(strategy, _case())
    assert closed == [True]
    assert result.reason is not None and "OutOfMemoryError: CUDA out of memory" in result.reason


@pytest.mark.usefixtures("process_group")
def test_without_the_dataloader_feed() -> None:
    result = _run(
        registry_module._REGISTRY["eager"], _case(), dataclasses.replace(QUICK, dataloader=False)
    )
    assert set(result.feeds) == {"device"}


@pytest.mark.usefixtures("process_group")
def test_control_phase_reports_the_failing_ranks() -> None:
    control = Control()
    assert control.phase("build", lambda: 7) == 7
    with pytest.raises(PhaseFailed) as info:
        control.phase("build", lambda: 1 / 0)
    assert info.value.errors == {0: "ZeroDivisionError: division by zero"}
    assert PhaseFailed("timing", {0: "E: x", 1: "E: x", 3: "E: y"}).describe() == (
        "failed during timing (ranks 0-1: E: x; rank 3: E: y)"
    )


def test_short_error_keeps_the_head() -> None:
    long = RuntimeError("first\n\nsecond\nthird\nfourth\nfifth")
    assert short_error(long) == "RuntimeError: first / second / third / fourth"
    assert short_error(KeyError()) == "KeyError"
    assert len(short_error(ValueError("x" * 5000))) == 600
