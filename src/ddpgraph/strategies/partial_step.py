"""`strategy="partial"`: graphs of submodules, the step itself eager.

The first call runs the step eagerly while recording what each submodule of the model
receives (and, on CUDA, where the host synchronises); right after it, the submodules are
graphed from those recorded calls (`ddpgraph.strategies.partial`). Every later call runs the step
eagerly, and the graphed submodules replay inside it. A model whose submodules were
graphed already with `graph_submodules` is used as it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import nn

from ..capture import StepState
from ..ddp import build as ddp_tools
from ..ddp.build import inner_module, process_group_of
from ..ddp.streams import can_run_graphs
from ..errors import usage_error
from ..findings import Code, Finding
from ..options import CaptureOptions
from .base import R, StepBase, run_eager
from .partial import DEFAULT_TOLERANCE, graph_recorded, partial_report, stand_in_grapher
from .partial_graphed import PartialGraphs, PartialReport
from .partial_record import record_step

SUMMARY = (
    "graphs of the largest submodules that capture (forward and backward each); the step, "
    "DDP's hooks, all-reduces and the optimizer step stay eager"
)


class PartialStep(StepBase[R]):
    strategy = "partial"

    def __init__(
        self,
        fn: Callable[..., R],
        *,
        model: nn.Module,
        options: CaptureOptions,
        names: Sequence[str] | None = None,
        tolerance: float = DEFAULT_TOLERANCE,
    ) -> None:
        super().__init__()
        self._fn = fn
        self._model = model
        self._root = inner_module(model)
        self._device = ddp_tools.model_device(model)
        self._stream = options.step_stream(model)
        self._names = list(names) if names is not None else None
        self._tolerance = tolerance
        # Read once, as the step is built: the one the first call graphs with.
        self._grapher = stand_in_grapher()
        self._graphs: PartialGraphs | None = None
        known = dict(self._root.named_modules())
        unknown = [n for n in self._names or () if n not in known]
        if unknown:
            raise usage_error(
                "`make_step(graph_modules=...)`",
                f"expected names from `model.named_modules()`, got {', '.join(map(repr, unknown))}",
                "name submodules of the model inside DDP ('' is the whole model)",
            )
        existing = partial_report(self._root)
        on_cuda = can_run_graphs(self._device)
        if existing is not None:
            self._settle_state(existing)
        elif not on_cuda and self._grapher is None:
            self._reason = Finding(
                Code.NO_CUDA,
                f"submodules are graphed with CUDA graphs and the model is on {self._device}; "
                "the step runs eagerly",
                subject="`make_step(strategy='partial')`",
            )
        else:
            self._state = StepState.WARMUP

    @property
    def description(self) -> str:
        return SUMMARY

    @property
    def report(self) -> PartialReport | None:
        """What was graphed and what was left eager, with why."""
        return partial_report(self._root)

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        self._check_open()
        self._stats.calls += 1
        if self._state is not StepState.WARMUP:
            if self._state is StepState.CAPTURED:
                self._stats.replays += 1
            else:
                self._stats.eager_steps += 1
            return run_eager(self._fn, args, kwargs, self._device, self._stream)
        on_cuda = can_run_graphs(self._device)
        with record_step(self._root, probe=on_cuda) as recorder:
            out = run_eager(self._fn, args, kwargs, self._device, self._stream)
        self._stats.warmup_steps += 1
        start = time.perf_counter()
        group = process_group_of(self._model)
        self._graphs = graph_recorded(
            self._root,
            recorder.records,
            names=self._names,
            tolerance=self._tolerance,
            grapher=self._grapher,
            group=group,
        )
        self._stats.capture_seconds = time.perf_counter() - start
        self._settle_state(self._graphs.report)
        return out

    def reference(self) -> AbstractContextManager[Any]:
        """The plain model: graphed submodules run their original forward inside."""
        return self._graphs.bypassed() if self._graphs is not None else nullcontext()

    def _settle_state(self, report: PartialReport) -> None:
        self._stats.captures = len(report.graphed)
        if report.graphed:
            self._state = StepState.CAPTURED
            return
        self._state = StepState.EAGER
        why = "; ".join(f"{s.name or 'the whole model'}: {s.why}" for s in report.skipped[:4])
        self._reason = Finding(
            Code.CAPTURE_FAILED,
            f"no submodule could be graphed ({why or 'the model has no parameters'}); "
            "the step runs eagerly",
            "see `step.report` for every submodule tried; name smaller ones with `graph_modules=`",
            subject="`make_step(strategy='partial')`",
        )

    def _release(self) -> None:
        if self._graphs is not None:
            self._graphs.release()
            self._graphs = None
