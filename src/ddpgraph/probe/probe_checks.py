"""What the probe step (the last warm-up step) watches besides host synchronisations.

Each check reports findings; the probe's agreement turns any of them into an eager
fallback on every rank, before anything is captured:

* an argument the step writes into (`count.add_(1)`: its version counter moved;
  `count.data.add_(1)`: its values moved, the version counter of `.data` being another),
  a new value put into an argument's list or dict (`state["loss_sum"] = ...`), or a
  tensor argument that requires grad and received a gradient: a replay works on the
  graph's own copy of each argument and runs no Python, so the caller would see none of
  them (the finding names the line, `write_sites`);
* an optimizer that stepped during the probe but was not passed as `optimizer=`: its
  hyper-parameters would be frozen into the graph (seen through torch's global
  optimizer step hook, where torch has one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.optim.optimizer as optimizer_module
from torch.optim import Optimizer

from ..findings import Code, Finding, Location
from ..inputs.arguments import flatten_call, leaf_paths
from ..step.write_sites import def_location, parameter_name, write_site
from .reseeds import reseed_finding, reseeds

Call = tuple[tuple[Any, ...], dict[str, Any]]


class ProbeWatch:
    """`call`: the arguments exactly as the step receives them (their containers too)."""

    def __init__(self, fn: Callable[..., Any], call: Call, optimizers: Sequence[Optimizer]) -> None:
        self._fn = fn
        self._call = call
        self._leaves, self._spec = flatten_call(*call)
        self._names = leaf_paths(*call, fn)
        self._tensors = [
            (n, t)
            for n, t in zip(self._names, self._leaves, strict=True)
            if isinstance(t, torch.Tensor)
        ]
        self._versions = [t._version for _, t in self._tensors]
        with torch.no_grad():
            self._values = [t.detach().clone() for _, t in self._tensors]
        self._declared = {id(o) for o in optimizers}
        self._optimizers = list(optimizers)
        self._stepped: dict[int, Optimizer] = {}  # stepped, not passed
        self._stepped_declared: set[int] = set()
        self._reseeded: list[Location | None] = []

    @contextmanager
    def watching(self) -> Iterator[None]:
        register = getattr(optimizer_module, "register_optimizer_step_post_hook", None)
        handle = register(self._on_step) if register is not None else None
        try:
            with reseeds() as self._reseeded:
                yield
        finally:
            if handle is not None:
                handle.remove()

    def _on_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if id(optimizer) not in self._declared:
            self._stepped[id(optimizer)] = optimizer
        else:
            self._stepped_declared.add(id(optimizer))

    def findings(self) -> list[Finding]:
        found: list[Finding] = []
        for (name, t), version, value in zip(
            self._tensors, self._versions, self._values, strict=True
        ):
            if t._version != version:
                found.append(_input_finding(name, "the step writes into it in place"))
            elif not _same_values(t, value):
                where = write_site(self._fn, parameter_name(self._fn, name), through_data=True)
                found.append(
                    _input_finding(
                        name,
                        "the step writes into it through `.data`, "
                        "which PyTorch's version counter does not see",
                        where,
                    )
                )
            elif t.requires_grad and t.is_leaf and t.grad is not None:
                found.append(
                    _input_finding(name, "it requires grad and the step gives it a gradient")
                )
        changed = self._container_write()
        if changed is not None:
            where = write_site(self._fn, parameter_name(self._fn, changed), through_data=False)
            found.append(
                _input_finding(changed, "the step puts a new value into its list or dict", where)
            )
        found += self._not_stepped()
        found += [reseed_finding(where) for where in self._reseeded]
        for opt in self._stepped.values():
            name = type(opt).__name__
            found.append(
                Finding(
                    Code.OPTIMIZER_NOT_PASSED,
                    f"a `{name}` stepped inside the step but was not passed as `optimizer=`; its "
                    "learning rate and other hyper-parameters would be frozen into the graph",
                    f"pass it too: `capture_step(fn, model=..., optimizer=[..., {name.lower()}])`",
                    subject="`capture_step(optimizer=...)`",
                )
            )
        return found

    def _container_write(self) -> str | None:
        """The first argument path whose value the step replaced, added or removed."""
        leaves, spec = flatten_call(*self._call)
        if spec == self._spec:
            for name, before, now in zip(self._names, self._leaves, leaves, strict=True):
                if before is not now:
                    return name
            return None
        now_names = leaf_paths(*self._call, self._fn)
        return next((n for n in now_names if n not in self._names), None) or next(
            (n for n in self._names if n not in now_names),
            self._names[0] if self._names else "args",
        )

    def _not_stepped(self) -> list[Finding]:
        """A passed optimizer that the step did not step: its gradients are left to code
        after the step, and a replay writes them into the graph's own tensors, where an
        optimizer stepped outside (after `zero_grad(set_to_none=True)`) never sees them:
        training would stop without a word. Step hooks tell (PyTorch 2.0 and later)."""
        if getattr(optimizer_module, "register_optimizer_step_post_hook", None) is None:
            return []
        where = def_location(self._fn)  # the user's, not a wrapper
        return [
            Finding(
                Code.UNSUPPORTED_SETUP,
                f"the step function did not step the `{type(opt).__name__}` passed as "
                "`optimizer=`: the gradients it computes are left to code after it, which "
                "replays cannot serve (a replay writes them into the graph's own tensors, "
                "so an optimizer stepped outside would stop updating without a word)",
                "step the optimizer inside the step function (`opt.zero_grad(set_to_none="
                "True)`, `loss.backward()`, `opt.step()`); to step it every N calls, "
                "accumulate the N micro-batches inside one step with `ddpgraph.accumulate`",
                subject="`capture_step(optimizer=...)`",
                location=where,
            )
            for opt in self._optimizers
            # An optimizer never stepped yet has no state: a loss scaler skips a first
            # step whose gradients overflowed (the state it would make stays unmade), and
            # that is not told from a loop's step after the call here.
            if id(opt) not in self._stepped_declared and opt.state
        ]


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.layout is not torch.strided:
        return True  # not compared: only the version counter tells
    if a.is_floating_point() or a.is_complex():
        return bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))
    return bool(torch.equal(a, b))


def _input_finding(name: str, what: str, where: Location | None = None) -> Finding:
    return Finding(
        Code.INPUT_CHANGED_BY_STEP,
        f"argument `{name}`: {what}; replays would work on the graph's copy of it and run "
        "no Python, and the caller's value would stop changing",
        "return the new value from the step instead, or keep that tensor out of the arguments",
        subject="`capture_step` call",
        location=where,
    )
