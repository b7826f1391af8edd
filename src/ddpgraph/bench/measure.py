"""Running one strategy on one case, in isolation, and measuring it.

The phases, each ended by an exchange between ranks (`Control.phase`):

1. model: a fresh model with the shared initial weights (a user's model may fail here);
   build: DDP, optimizer, compiled module, whatever the strategy wraps around it;
2. warm-up on the device feed: compilation, DDP's first iterations, capture;
3. timing on the device feed: windows of steps, synchronised only at window edges;
4. profile (rank 0, on CUDA): a few steps under torch.profiler for the kernel time;
5. with the DataLoader feed: warm-up (a captured strategy captures again for pinned host
   inputs; the warm-up goes on, up to `LOADER_WARMUP_ROUNDS` times, until it has on every
   rank), then timing the same way.

Each feed's timing counts the calls a captured strategy ran eagerly (`eager_calls`): a
graph that serves no call must show, not pass for a slow graph.

Peak memory is reset before the build and read after the device-feed phases. Whatever
happens, the runner is closed and its memory returned before the next strategy.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from functools import partial

import torch

from ..app.reference_step import Timing
from ..ddp.streams import synchronize
from .busy import GpuProfile, profile_steps
from .case import Case, Runner
from .control import Control, PhaseFailed, short_error
from .feeds import Batch, device_feed, loader_feed
from .registry import Strategy
from .schema import FEED_TITLES, FeedResult, StrategyResult
from .settings import Settings
from .stats import Measurement, ratio, windows

MIB = 1024 * 1024
# The DataLoader warm-up is repeated until a strategy captured on the device feed has
# captured again, at most this many times in all.
LOADER_WARMUP_ROUNDS = 3


def run_strategy(
    strategy: Strategy,
    case: Case,
    batches: list[Batch],
    settings: Settings,
    control: Control,
    *,
    profile_here: bool,
    on_phase: Callable[[str], None] = lambda phase: None,
) -> StrategyResult:
    result = StrategyResult(case.workload.name, case.batch_size, strategy.name)
    skip = strategy.skip_reason(case.on_cuda)
    if skip is not None or strategy.build is None:
        result.status, result.reason = "skipped", skip
        return result
    build = strategy.build
    label = f"{strategy.name} ({case.workload.name}, batch {case.batch_size})"
    started = time.perf_counter()
    runner: Runner | None = None

    def fresh_model() -> torch.nn.Module:
        _release_memory(case.device)
        return case.fresh_model()

    try:
        on_phase("build")
        model = control.phase("model", fresh_model, label=label)
        runner = control.phase("build", partial(build, case, model), label=label)
        del model  # the runner holds it now; the cleanup below must free it
        _measure(runner, case, batches, settings, control, result, profile_here, on_phase, label)
    except PhaseFailed as failure:
        result.status, result.reason = "failed", failure.describe()
    finally:
        # Cleanup failures (a CUDA error that outlived the strategy) are noted, not
        # raised: the next strategy's phases will report whatever is still broken.
        problems = []
        try:
            if runner is not None:
                runner.close()
        except Exception as err:
            problems.append(f"closing it failed: {short_error(err)}")
        del runner
        try:
            _release_memory(case.device)
        except Exception as err:
            problems.append(f"freeing its memory failed: {short_error(err)}")
        if problems:
            result.note = "\n".join(filter(None, [result.note, *problems]))
    result.wall_s = time.perf_counter() - started
    return result


def _measure(
    runner: Runner,
    case: Case,
    batches: list[Batch],
    settings: Settings,
    control: Control,
    result: StrategyResult,
    profile_here: bool,
    on_phase: Callable[[str], None],
    label: str,
) -> None:
    device = case.device
    feed = device_feed(batches, device)
    last: list[torch.Tensor] = []

    def steps(source: Iterator[Batch], count: int) -> None:
        for _ in range(count):
            x, y = next(source)
            last[:] = [runner.step(x, y)]
        synchronize(device)

    on_phase("warm-up")
    control.phase("warm-up", lambda: steps(feed, settings.warmup), label=label)
    on_phase("timing")
    before = runner.eager_calls
    timing = control.phase(
        "timing", lambda: _timed(runner, feed, settings, device, last), label=label
    )
    device_eager = _since(before, runner.eager_calls)
    profiled = partial(steps, feed, settings.profile_steps)
    gpu = _profile(case, settings, control, profile_here, on_phase, label, profiled)
    active_ms, why = gpu.active_ms_per_step, gpu.why
    result.kernel_ms_per_step = gpu.kernel_ms_per_step
    result.gpu_timeline = gpu.timeline
    result.feeds["device"] = _feed_result(timing, active_ms, device_eager)
    if case.on_cuda:
        peaks = control.gather(torch.cuda.max_memory_allocated(device))
        result.peak_memory_mib = max(peaks) / MIB
    if settings.dataloader:
        _measure_loader(
            runner,
            case,
            batches,
            settings,
            control,
            result,
            on_phase,
            label,
            steps,
            last,
            active_ms,
        )
    control.phase(
        "reading the results",
        lambda: _read_outcome(runner, result, settings, last, why),
        label=label,
    )


def _profile(
    case: Case,
    settings: Settings,
    control: Control,
    profile_here: bool,
    on_phase: Callable[[str], None],
    label: str,
    run_steps: Callable[[], None],
) -> GpuProfile:
    """The profile phase, on CUDA only. A rank that does not profile still runs the same
    steps, so that every rank's DDP step count stays equal."""
    if not (case.on_cuda and settings.profile_steps > 0):
        return GpuProfile()
    on_phase("profile")

    def profile() -> GpuProfile:
        if not profile_here:
            run_steps()
            return GpuProfile()
        return profile_steps(run_steps, settings.profile_steps, case.device)

    return control.phase("profile", profile, label=label)


def _read_outcome(
    runner: Runner,
    result: StrategyResult,
    settings: Settings,
    last: list[torch.Tensor],
    why: str | None,
) -> None:
    """Fill in what the row reports beyond timings: the final loss, capture outcome, note."""
    result.final_loss = float(last[0]) if last else None
    result.capture_s = runner.capture_seconds
    result.captured = runner.captured
    eager = eager_calls_note(result, settings.timed_steps)
    result.note = "\n".join(filter(None, [eager, runner.note(), why])) or None


def _measure_loader(
    runner: Runner,
    case: Case,
    batches: list[Batch],
    settings: Settings,
    control: Control,
    result: StrategyResult,
    on_phase: Callable[[str], None],
    label: str,
    steps: Callable[[Iterator[Batch], int], None],
    last: list[torch.Tensor],
    active_ms: float | None,
) -> None:
    """The DataLoader feed: its warm-up (again while a captured step went eager) and timing."""
    loader = loader_feed(
        batches,
        LOADER_WARMUP_ROUNDS * settings.loader_warmup + settings.timed_steps,
        workers=settings.loader_workers,
        pin_memory=case.on_cuda,
    )
    was_captured = runner.captured is True
    try:
        on_phase("DataLoader warm-up")
        for _ in range(LOADER_WARMUP_ROUNDS):
            control.phase(
                "DataLoader warm-up", lambda: steps(loader, settings.loader_warmup), label=label
            )
            if not was_captured or all(control.gather(runner.captured is True)):
                break
        on_phase("DataLoader timing")
        before = runner.eager_calls
        loaded = control.phase(
            "DataLoader timing",
            lambda: _timed(runner, loader, settings, case.device, last),
            label=label,
        )
        loader_eager = _since(before, runner.eager_calls)
    finally:
        loader.close()
    result.feeds["dataloader"] = _feed_result(loaded, active_ms, loader_eager)


def _timed(
    runner: Runner,
    feed: Iterator[Batch],
    settings: Settings,
    device: torch.device,
    last: list[torch.Tensor],
) -> Timing:
    """Time the steps in windows; the host runs ahead freely inside a window."""
    timing = Timing()
    synchronize(device)
    for count in windows(settings.steps, settings.window):
        start = time.perf_counter()
        for _ in range(count):
            x, y = next(feed)
            last[:] = [runner.step(x, y)]
        synchronize(device)
        timing.window_ms.append((time.perf_counter() - start) * 1000.0 / count)
    return timing


def _since(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before


def eager_calls_note(result: StrategyResult, timed_steps: int) -> str | None:
    """What a row's note says of the timed calls a captured strategy ran eagerly."""
    said = [
        f"{n} of {timed_steps} timed calls ran eagerly with the {FEED_TITLES.get(feed, feed)}"
        for feed, timed in result.feeds.items()
        if (n := timed.eager_calls)
    ]
    return "; ".join(said) or None


def _feed_result(
    timing: Timing, active_ms: float | None, eager_calls: int | None = None
) -> FeedResult:
    m = Measurement.of(timing)
    # Capped: the profiled steps' device work can exceed an unprofiled step's wall time
    # by the timing's noise when the GPU never rests.
    busy = ratio(active_ms, m.ms_per_step)
    return FeedResult(
        m.ms_per_step,
        m.spread_ms,
        m.window_ms,
        gpu_busy=None if busy is None else min(busy, 1.0),
        eager_calls=eager_calls,
    )


def _release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
