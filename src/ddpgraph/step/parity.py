"""A parity check at capture: the same step, once eager and once replayed, compared.

`capture_step(..., parity=ParityCheck(rtol=...))` (or `parity=True`) checks, on the call
that captures, that the graph computes what eager training with the same settings
computes. `ParityRun` is self-contained; the capture engine calls it at one point, in
place of the first replay:

1. save the training state: parameters, gradients, buffers, the optimizers' state, the
   scaler, the random number generators (value copies: the graph reads these tensors, so
   everything is put back in place);
2. run the step eagerly (in the graph-safe mode, `safe_optimizers`); record its outputs
   and the parameters;
3. put the saved state back; replay the graph on the same inputs;
4. compare: the largest relative difference of any parameter tensor
   (max |eager - replayed| / max |eager|) and of any output, against `rtol`.

The state after the check is the replayed step's. Each rank checks its own; the engine
agrees on the outcomes, and a mismatch on any rank is answered on every rank by
`on_failure` (after `undo()`, which puts the saved state back so that the call can run
eagerly instead).

Cost: one eager step more at capture, and a copy of parameters, gradients, buffers and
optimizer state held during it (for AdamW about 4x the parameters' memory).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_leaves

from ..ddp.process import current_rank
from ..errors import usage_error
from ..findings import Code, Finding
from .same_path import synchronised_at

R = TypeVar("R")


@dataclass(frozen=True)
class ParityCheck:
    """How close a replayed step must be to the same step run eagerly.

    `rtol` bounds the relative difference max |eager - replayed| / max |eager| of each
    parameter tensor and each output tensor; 0.0 (the default) asks for bit-for-bit
    equality, which a graph of the same kernels gives."""

    rtol: float = 0.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.rtol, bool)
            or not isinstance(self.rtol, (int, float))
            or not self.rtol >= 0
        ):
            raise usage_error(
                "`ParityCheck(rtol=...)`",
                f"expected a number >= 0, got {self.rtol!r}",
                "use 0.0 for bit-for-bit equality, or a small tolerance such as 1e-6",
            )


def as_parity_check(value: ParityCheck | bool | None) -> ParityCheck | None:
    """The `parity=` argument of `capture_step`: a `ParityCheck`, True (bit-for-bit) or
    None / False (no check)."""
    if value is None or value is False:
        return None
    if value is True:
        return ParityCheck()
    if isinstance(value, ParityCheck):
        return value
    raise usage_error(
        "`capture_step(parity=...)`",
        f"expected a ddpgraph.ParityCheck, True or None, got {type(value).__name__}",
        "pass `parity=ddpgraph.ParityCheck(rtol=1e-6)` or `parity=True` for bit-for-bit",
    )


class _Saved:
    """Value copies of everything a training step changes, put back in place."""

    def __init__(
        self,
        model: nn.Module,
        optimizers: Sequence[Optimizer],
        generators: Sequence[torch.Generator],
    ) -> None:
        self.params = [(p, p.detach().clone(), p.grad, _clone(p.grad)) for p in model.parameters()]
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.state = [
            (
                opt,
                {p: dict(s) for p, s in opt.state.items()},
                [(t, t.clone()) for t in _state_tensors(opt)],
            )
            for opt in optimizers
        ]
        self.generators = [(g, g.get_state()) for g in generators]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = (
            torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )

    def restore(self) -> None:
        with torch.no_grad():
            for p, value, grad, grad_value in self.params:
                p.copy_(value)
                p.grad = grad
                if grad is not None and grad_value is not None:
                    grad.copy_(grad_value)
            for b, value in self.buffers:
                b.copy_(value)
            for opt, refs, values in self.state:
                opt.state.clear()
                opt.state.update({p: dict(s) for p, s in refs.items()})
                for t, value in values:
                    t.copy_(value)
        for g, state in self.generators:
            g.set_state(state)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def nbytes(self) -> int:
        copies = [v for _, v, _, _ in self.params] + [
            g for _, _, _, g in self.params if g is not None
        ]
        copies += [v for _, v in self.buffers] + [v for _, _, vs in self.state for _, v in vs]
        return sum(t.numel() * t.element_size() for t in copies)


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def _state_tensors(opt: Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def relative_difference(expected: torch.Tensor, got: torch.Tensor) -> float:
    """max |expected - got| / max |expected| (the absolute difference where expected is 0)."""
    if expected.shape != got.shape:
        return float("inf")
    got = got.detach().to(expected.device)
    if torch.equal(expected, got):  # the usual case, and the cheap one
        return 0.0
    a, b = expected.detach().double(), got.double()
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    scale = a.abs().max().item() if a.numel() else 0.0
    return diff / scale if scale > 0 else diff


class ParityRun:
    """One check (see the module docstring). `run` returns the replay's outputs and sets
    `finding` (None when within tolerance), `parameter_difference`, `output_difference`
    and `saved_bytes`."""

    def __init__(
        self,
        check: ParityCheck,
        model: nn.Module,
        optimizers: Sequence[Optimizer],
        generators: Sequence[torch.Generator] = (),
        undo: Sequence[Callable[[], Callable[[], None]]] = (),
        library_branch: Finding | None = None,
    ) -> None:
        self.check = check
        # A host synchronisation an installed library made in the probe step and skips
        # while a graph is recorded: the graph runs that library's other branch there.
        self.library_branch = library_branch
        self.model = model
        self.optimizers = list(optimizers)
        self.generators = list(generators)
        self.undo_makers = list(undo)  # e.g. the scaler's `_snapshot`
        self.finding: Finding | None = None
        self.parameter_difference = 0.0
        self.output_difference = 0.0
        self.saved_bytes = 0
        self._saved: _Saved | None = None
        self._undo: list[Callable[[], None]] = []

    def run(self, eager: Callable[[], R], replay: Callable[[], R]) -> R:
        self._saved = _Saved(self.model, self.optimizers, self.generators)
        self._undo = [make() for make in self.undo_makers]
        self.saved_bytes = self._saved.nbytes()
        eager_out = [t.detach().clone() for t in _tensors(eager())]
        eager_params = [p.detach().clone() for p in self.model.parameters()]
        self.undo()
        out = replay()
        self.parameter_difference = _largest(
            eager_params, [p.detach() for p in self.model.parameters()]
        )
        self.output_difference = _largest(eager_out, _tensors(out))
        self.finding = self._judge()
        return out

    def undo(self) -> None:
        """Put the state saved before the check back (where the eager step began)."""
        assert self._saved is not None
        self._saved.restore()
        for put_back in self._undo:
            put_back()

    def release(self) -> None:
        self._saved = None
        self._undo = []

    def _judge(self) -> Finding | None:
        worst = max(self.parameter_difference, self.output_difference)
        if worst <= self.check.rtol:
            return None
        tolerance = "bit-for-bit equality" if self.check.rtol == 0 else f"rtol={self.check.rtol:g}"
        happened = (
            f"the replayed step differs from the same step run eagerly: parameters by "
            f"{self.parameter_difference:.3g}, outputs by {self.output_difference:.3g} "
            f"(largest relative difference of a tensor; asked for {tolerance})"
        )
        fix = ""
        if self.library_branch is not None:
            where = synchronised_at(self.library_branch)
            happened += (
                f". The likely cause: a library computes part of the step another way while a "
                f"graph is recorded; in eager steps {where}, a host synchronisation it skips "
                "while recording (transformers does, to build attention masks)"
            )
            fix = (
                "the graph is right for any input, and differs from eager by that branch's "
                "rounding: accept it with `ParityCheck(rtol=...)` above the size measured here, "
                "or keep eager steps where bit-for-bit equality with eager training matters"
            )
        return Finding(
            Code.PARITY_MISMATCH,
            happened,
            fix,
            subject="`capture_step(parity=...)`",
            ranks=(current_rank(),),
        )


def _tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def _largest(expected: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    if len(expected) != len(got):
        return float("inf")
    return max((relative_difference(a, b) for a, b in zip(expected, got, strict=True)), default=0.0)
