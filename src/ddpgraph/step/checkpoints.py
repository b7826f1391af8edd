"""A checkpoint loaded into a live captured step: the optimizer's and the model's
`load_state_dict` hooks. A load keeps the graph's storage (the loaded values are copied
into the captured tensors); one that cannot be copied is reported, and the step is
captured again once the ranks agree."""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn
from torch.optim import Optimizer

from ..backends.graph import GraphBackend
from ..cycle.step_state import StepState
from ..ddp import build as ddp_tools
from ..findings import Finding
from ..optimizer.safe_optimizers import GraphSafeOptimizers
from .checked_calls import CheckedCalls
from .param_guard import ParamLayout

R = TypeVar("R")


class StepCheckpoints(CheckedCalls[R]):
    """The load hooks of `CapturedStep`, which sets these fields."""

    _optim: GraphSafeOptimizers
    _model: nn.Module
    _layout: ParamLayout | None
    _hooks: list[Any]
    _backend: GraphBackend | None
    _setup_refusal: Finding | None

    def _install_load_hooks(self) -> None:
        for opt in self._optim.optimizers:
            if hasattr(opt, "register_load_state_dict_post_hook"):
                self._hooks.append(
                    opt.register_load_state_dict_post_hook(self._after_optimizer_load)
                )
        inner = ddp_tools.inner_module(self._model)
        self._hooks.append(inner.register_load_state_dict_post_hook(self._after_model_load))

    def _after_optimizer_load(self, optimizer: Optimizer) -> None:
        """Keep the graph's storage: copy loaded values into the captured tensors; a load
        that cannot be copied is reported, and re-captured once the ranks agree."""
        if self._state is StepState.CAPTURED:
            report = self._optim.check_load(optimizer)
            if report is not None:
                self.report(report)
        elif self._backend is not None:
            # Warming up, or eager after a fallback (whose steps run in the graph-safe
            # mode too): the mirrors follow the optimizer as loaded.
            self._optim.released()
            self._setup_refusal = self._optim.prepare()

    def _after_model_load(self, module: nn.Module, incompatible: Any) -> None:
        if self._state is StepState.CAPTURED and self._layout is not None:
            report = self._layout.replaced(self._model)
            if report is not None:
                self.report(report)
