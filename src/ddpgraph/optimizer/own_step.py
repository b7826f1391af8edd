"""ddpgraph's own update (`own_updates`) as one optimizer's `step`, while ddpgraph runs it.

Used only when needed: when a schedule changes the hyper-parameter that PyTorch's
graph-safe kernel reads only as a Python number (Adam's `betas[0]`, SGD's `momentum`),
seen between two warm-up calls or, after capture, before a replay (`hyperparams`).
Until then PyTorch's own kernel runs, so a step whose hyper-parameters stay put keeps
exactly the kernel it always had; from then on every step ddpgraph runs of that
optimizer (eager ones and the recording) runs the own update, which at fixed values
computes what the kernel computes, bit for bit.

`OwnStep` keeps, per param group, the 0-dim tensors the update reads (the live value and
what PyTorch derives from it on the host), fills them from the user's Python number
before each call (a `fill_` per tensor when it changed, no host read), and installs the
update as `optimizer.step` only while ddpgraph runs the step: through
`Optimizer.profile_hook_step`, so step hooks run as around PyTorch's own step. The user's
`step` (an LR scheduler's wrapper included) is put back after.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
from torch.optim import Optimizer

from .own_updates import Live, OwnUpdate, is_number, tensor_dtype

_MISSING = object()


class OwnStep:
    """One optimizer's own update: its live tensors, filled before each call, and its
    installation as `optimizer.step` (see the module docstring)."""

    def __init__(self, optimizer: Optimizer, update: OwnUpdate, device: torch.device) -> None:
        self.optimizer = optimizer
        self.update = update
        self.device = device
        self.live: list[Live] = [self._tensors(group) for group in optimizer.param_groups]
        self._filled: list[Any] = [_MISSING] * len(self.live)
        self._given: Any = _MISSING

    def _tensors(self, group: dict[str, Any]) -> Live:
        dtypes = {torch.float32} | {tensor_dtype(p.dtype) for p in group["params"]}
        return {
            name: {d: torch.zeros((), dtype=d, device=self.device) for d in sorted(dtypes, key=str)}
            for name, _ in self.update.derived
        }

    def fill(self, index: int, value: Any) -> bool:
        """Write group `index`'s live value into its tensors; False when it is not a
        Python number (a form the update does not take)."""
        live = self.update.live_value(value)
        if not is_number(live):
            return False
        if self._filled[index] is not _MISSING and live == self._filled[index]:
            return True
        for name, derive in self.update.derived:
            # Derived on the host in double, then rounded once by the fill: what the
            # kernel does with the Python number.
            number = derive(float(live))
            for tensor in self.live[index][name].values():
                tensor.fill_(number)
        self._filled[index] = live
        return True

    def filled(self, index: int) -> Any:
        """The live value group `index`'s tensors hold (None before the first fill)."""
        value = self._filled[index]
        return None if value is _MISSING else value

    def install(self) -> None:
        opt = self.optimizer
        self._given = opt.__dict__.get("step", None)
        # An LR scheduler wraps `step` to note that it was called (its warning about the
        # order of `optimizer.step()` and `scheduler.step()` reads the note).
        notes_call = getattr(self._given, "_wrapped_by_lr_sched", False)
        own = self

        def step(optimizer: Optimizer, closure: Any = None) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if notes_call:
                optimizer._opt_called = True  # type: ignore[attr-defined]
            with torch.no_grad():
                for group, live in zip(optimizer.param_groups, own.live, strict=True):
                    own.update.step_group(optimizer, group, live)
            return loss

        opt.step = MethodType(Optimizer.profile_hook_step(step), opt)  # type: ignore[method-assign]

    def uninstall(self) -> None:
        if self._given is _MISSING:
            return
        if self._given is None:
            del self.optimizer.step
        else:
            self.optimizer.step = self._given  # type: ignore[method-assign]
        self._given = _MISSING
