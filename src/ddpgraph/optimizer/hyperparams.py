"""The device tensors a captured optimizer step reads in place of the user's hyper-parameters.

A CUDA graph copies every Python number it reads into its kernels at recording. Rather
than rewrite the user's `param_groups` into tensors for good (schedulers would then do
their arithmetic in float32, `get_last_lr()` would return device tensors, and checkpoints
would carry them), a `HyperparamMirror` keeps its own 0-dim tensors, one per
tensor-capable hyper-parameter (`kernel_support`), and:

* `sync()` fills them from the user's values before every replay: one `fill_` per value
  that changed since the last fill, compared on the host, so no host synchronisation;
* `install()` / `uninstall()` put them (and the graph-safe flags, `capturable=True` or
  fused SGD) into the param groups only while a step records or runs eagerly, so the
  eager steps compute exactly what the graph computes;
* `frozen_changes()` reports a hyper-parameter that stays a Python number in the graph
  and changed since capture (answered with LR_BAKED_INTO_GRAPH), compared by value: a
  list changed in place (`group["betas"][1] = 0.5`) is a change too;
* the value a schedule cycles that the kernel reads only as a Python number (Adam's
  `betas[0]`, SGD's `momentum`; `kernel_support`'s `own_keys`) is followed by
  ddpgraph's own update (`own_step`) from the call on which it is first seen changing:
  between two calls while warming up, or before a replay (a change that asks for a new
  capture, `HyperparamChange.followable`). Until then PyTorch's kernel runs.

Between calls the user's optimizer holds exactly what the user (or a scheduler) put there.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import is_
from typing import Any

import torch
from torch.optim import Optimizer

from .hyperparam_slot import HyperparamSlot
from .kernel_support import KernelSupport, hyperparameter_keys
from .own_step import OwnStep
from .own_updates import is_number, own_update

_MISSING = object()
# Attributes the graph-safe flags imply, set as the constructor would set them.
_FUSED_ATTRS = {"_step_supports_amp_scaling": True, "_need_device_dtype_check_for_fused": True}
# Silences "capturable=True ... step() is running without CUDA graph capture": ddpgraph
# runs those eager steps on purpose, so that they compute what the graph computes.
_CAPTURABLE_ATTRS = {"_warned_capturable_if_run_uncaptured": True}


@dataclass(frozen=True)
class HyperparamChange:
    group: int
    key: str
    before: Any
    after: Any
    applied: bool  # reaches the graph (a mirrored value); False: frozen in the graph
    # A frozen value that ddpgraph's own update reads from a tensor once a new capture
    # installs it (a schedule cycling `betas[0]` or `momentum`).
    followable: bool = False


class HyperparamMirror:
    """The graph's view of one optimizer's hyper-parameters (see the module docstring).
    `previous`: the mirror this one replaces (the optimizer's groups or state changed),
    whose knowledge of a cycled value it keeps."""

    def __init__(
        self,
        optimizer: Optimizer,
        supports: list[KernelSupport],
        device: torch.device,
        previous: HyperparamMirror | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.supports = supports
        self.device = device
        self.slots = [
            {k: HyperparamSlot(group[k], device) for k in support.tensor_keys}
            for group, support in zip(optimizer.param_groups, supports, strict=True)
        ]
        self._given: list[dict[str, Any]] | None = None
        self._attrs: dict[str, Any] = {}
        self._frozen: list[dict[str, Any]] | None = None
        # Per group, the keys a replay looks at, the objects they held at the last
        # replay that found nothing to do, and copies of the lists among them (None:
        # look at everything next time).
        self._seen: list[_Seen] | None = None
        update = own_update(optimizer)
        capable = update is not None and all(update.key in s.own_keys for s in supports)
        self.own_update = update if capable else None
        self.own: OwnStep | None = None
        # Per group, the live value at the last call while warming up.
        self._last_live: list[Any] = [_MISSING] * len(self.slots)
        if previous is not None and len(previous._last_live) == len(self._last_live):
            self._last_live = list(previous._last_live)
        if previous is not None and previous.own is not None and self.own_update is not None:
            self.schedule()

    @property
    def installed(self) -> bool:
        return self._given is not None

    def matches_groups(self) -> bool:
        return len(self.optimizer.param_groups) == len(self.slots)

    def schedule(self) -> None:
        """From now on ddpgraph's own update steps this optimizer, its cycled value read
        from tensors (filled at the next `sync`)."""
        assert self.own_update is not None and not self.installed
        if self.own is None:
            self.own = OwnStep(self.optimizer, self.own_update, self.device)

    def sync(self) -> list[HyperparamChange]:
        """Fill the tensors from the user's values; the changes that cannot be filled."""
        unapplied = []
        groups = self.optimizer.param_groups
        for i, (group, slots) in enumerate(zip(groups, self.slots, strict=False)):
            for key, slot in slots.items():
                value = group.get(key)
                if not slot.sync(value):
                    unapplied.append(HyperparamChange(i, key, slot.packed, value, False))
        update = self.own_update
        if update is None:
            return unapplied
        if self.own is None and self._frozen is None:
            # Warming up: a value that changed since the last call is a schedule's.
            lives = [update.live_value(g.get(update.key)) for g in groups]
            if any(
                is_number(v) and is_number(w) and v != w
                for v, w in zip(lives, self._last_live, strict=False)
            ):
                self.schedule()
            self._last_live = lives
        if self.own is not None:
            for i, group in enumerate(groups[: len(self.slots)]):
                value = group.get(update.key)
                if not self.own.fill(i, value):
                    unapplied.append(
                        HyperparamChange(i, update.key, self.own.filled(i), value, False)
                    )
        return unapplied

    def install(self) -> None:
        """Put the tensors and the graph-safe flags into the param groups, and the own
        update in place of `step` where a schedule cycles its value."""
        assert self._given is None, "the graph-safe mode is already installed"
        self._given = []
        for group, slots, support in zip(
            self.optimizer.param_groups, self.slots, self.supports, strict=True
        ):
            flags = dict(support.flags)
            self._given.append({k: group.get(k, _MISSING) for k in (*slots, *flags)})
            for key, slot in slots.items():
                group[key] = slot.packed
            group.update(flags)
        set_flags = {k for s in self.supports for k, _ in s.flags}
        wanted = {
            **(_FUSED_ATTRS if "fused" in set_flags else {}),
            **(_CAPTURABLE_ATTRS if "capturable" in set_flags else {}),
        }
        if self.own is not None:
            # The own update takes no `grad_scale`/`found_inf`: a GraphSafeGradScaler
            # unscales and skips around it, as for any non-fused kernel.
            wanted["_step_supports_amp_scaling"] = False
            self.own.install()
        self._attrs = {k: getattr(self.optimizer, k, _MISSING) for k in wanted}
        for k, v in wanted.items():
            setattr(self.optimizer, k, v)

    def uninstall(self, *, read_back: bool = False) -> None:
        """Give the param groups back their own values. A value the step assigned
        meanwhile is kept; with `read_back`, so is one it wrote into a mirror tensor."""
        if self._given is None:
            return
        for group, given, slots in zip(
            self.optimizer.param_groups, self._given, self.slots, strict=True
        ):
            for key, value in given.items():
                slot = slots.get(key)
                if slot is not None and group.get(key) is not slot.packed:
                    continue  # assigned inside the step: the user's new value
                if value is _MISSING:
                    group.pop(key, None)
                else:
                    group[key] = slot.read_back(value) if slot is not None and read_back else value
        for k, v in self._attrs.items():
            if v is _MISSING:
                if hasattr(self.optimizer, k):
                    delattr(self.optimizer, k)
            else:
                setattr(self.optimizer, k, v)
        if self.own is not None:
            self.own.uninstall()
        self._given = None
        self._attrs = {}

    def freeze(self) -> None:
        """Remember the values the graph holds as Python numbers (at capture)."""
        self._seen = None
        self._frozen = [
            {k: _kept(group[k]) for k in self._frozen_keys(group, slots, support)}
            for group, slots, support in zip(
                self.optimizer.param_groups, self.slots, self.supports, strict=True
            )
        ]

    def thaw(self) -> None:
        self._frozen = None
        self._seen = None

    def before_replay(self) -> list[HyperparamChange]:
        """`sync()` then `frozen_changes()`. In the usual replay no key of any group was
        assigned since the last one: the same objects as then, seen by one identity pass
        per group in C (and a comparison per list among them), and nothing else to do."""
        groups = self.optimizer.param_groups
        seen = self._seen
        if seen is None or len(groups) != len(seen):
            return self._full_pass()
        for i, (group, (keys, values, lists)) in enumerate(zip(groups, seen, strict=True)):
            if lists and any(group.get(k) != copy for k, copy in lists):
                return self._full_pass()  # a list changed in place
            if not all(map(is_, map(group.get, keys), values)) and not self._follow(
                i, group, keys, values
            ):
                return self._full_pass()
        return []

    def _full_pass(self) -> list[HyperparamChange]:
        changes = self.sync() + self.frozen_changes()
        self._seen = None if changes else self._snapshot()
        return changes

    def _follow(
        self, i: int, group: dict[str, Any], keys: tuple[str, ...], values: tuple[Any, ...]
    ) -> bool:
        """A scheduler's step: only the keys assigned since the last replay are looked at
        (a fill per mirrored value, a comparison per frozen one); False where that is not
        enough (a frozen value changed, a value of another form, a tensor value)."""
        assert self._seen is not None and self._frozen is not None
        now = tuple(map(group.get, keys))
        slots, frozen = self.slots[i], self._frozen[i]
        for key, before, after in zip(keys, values, now, strict=True):
            if after is before:
                continue
            slot = slots.get(key)
            if slot is not None:
                if not slot.sync(after) or slot.has_tensor:
                    return False
            elif self.own is not None and key == self.own.update.key:
                update = self.own.update
                if update.frozen_part(frozen.get(key)) != update.frozen_part(
                    after
                ) or not self.own.fill(i, after):
                    return False
            elif not _same(frozen.get(key, _MISSING), after):
                return False
        self._seen[i] = _seen_of(group, keys)
        return True

    def _snapshot(self) -> list[_Seen] | None:
        if self._frozen is None or any(
            s.has_tensor for slots in self.slots for s in slots.values()
        ):
            return None  # a tensor value is copied on every sync: it may change in place
        return [
            _seen_of(group, (*slots, *frozen))
            for group, slots, frozen in zip(
                self.optimizer.param_groups, self.slots, self._frozen, strict=True
            )
        ]

    def frozen_changes(self) -> list[HyperparamChange]:
        """Frozen hyper-parameters that differ from their value at capture."""
        if self._frozen is None:
            return []
        groups = self.optimizer.param_groups
        if len(groups) != len(self._frozen):
            return [HyperparamChange(-1, "param_groups", len(self._frozen), len(groups), False)]
        changes = []
        update = self.own_update
        for i, (group, frozen) in enumerate(zip(groups, self._frozen, strict=True)):
            for key, before in frozen.items():
                after = group.get(key, _MISSING)
                if update is not None and key == update.key:
                    same_frozen = update.frozen_part(before) == update.frozen_part(after)
                    if self.own is not None:
                        if not same_frozen:
                            changes.append(HyperparamChange(i, key, before, after, False))
                        continue
                    if not _same(before, after):
                        followable = same_frozen and is_number(update.live_value(after))
                        changes.append(HyperparamChange(i, key, before, after, False, followable))
                elif after is not before and not _same(before, after):
                    changes.append(HyperparamChange(i, key, before, after, False))
        return changes

    def _frozen_keys(
        self, group: dict[str, Any], slots: dict[str, HyperparamSlot], support: KernelSupport
    ) -> list[str]:
        # The flags the graph-safe mode sets are the same in every step it runs, whatever
        # the user's (or a loaded checkpoint's) own values are; a value only the first
        # step reads (captures come after it) no step after it reads either.
        skip = {*slots, *dict(support.flags), *support.first_step_only}
        return [k for k in hyperparameter_keys(self.optimizer, group) if k not in skip]


# Keys, the objects they held, and (key, copy) for each list among them.
_Seen = tuple[tuple[str, ...], tuple[Any, ...], tuple[tuple[str, list[Any]], ...]]


def _seen_of(group: dict[str, Any], keys: tuple[str, ...]) -> _Seen:
    values = tuple(map(group.get, keys))
    lists = tuple((k, list(v)) for k, v in zip(keys, values, strict=True) if isinstance(v, list))
    return keys, values, lists


def _kept(value: Any) -> Any:
    """A value as captured: a list is copied, so that a change in place shows."""
    return list(value) if isinstance(value, list) else value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        # A list and a tuple of the same numbers are read alike by every kernel.
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:
        return False
