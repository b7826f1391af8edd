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
  and changed since capture (answered with LR_BAKED_INTO_GRAPH).

Between calls the user's optimizer holds exactly what the user (or a scheduler) put there.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import is_
from typing import Any

import torch
from torch.optim import Optimizer

from .kernel_support import KernelSupport, hyperparameter_keys, is_number

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


class _Slot:
    """One mirrored hyper-parameter: a tensor per element (a scalar, or `betas`' two)."""

    def __init__(self, value: Any, device: torch.device) -> None:
        self.is_tuple = isinstance(value, (tuple, list))
        values = list(value) if self.is_tuple else [value]
        self.tensors: list[torch.Tensor] = []
        self.filled: list[Any] = []
        # Each tensor's version counter when last written here: an in-place write by
        # anything else bumps it, which is how `read_back` knows, without a host read.
        self.versions: list[int] = []
        for v in values:
            if isinstance(v, torch.Tensor) and _usable(v, device):
                self.tensors.append(v)  # the user's own device tensor: the graph reads it
                self.filled.append(v)
            else:
                self.tensors.append(torch.zeros((), dtype=torch.float32, device=device))
                self.filled.append(_MISSING)
        # One object, so that an identity check tells it from a value assigned meanwhile.
        self.packed: Any = tuple(self.tensors) if self.is_tuple else self.tensors[0]
        self.versions = [-1] * len(self.tensors)
        # The last value filled that holds only numbers: the same object again (the usual
        # replay, where nothing assigned the key) needs no look at all.
        self._synced: Any = _MISSING
        self.sync(value)

    def sync(self, value: Any) -> bool:
        """Write `value` into the tensors; False when it has another form (frozen)."""
        if value is self._synced:
            return True
        if self.is_tuple:
            if not isinstance(value, (tuple, list)) or len(value) != len(self.tensors):
                return False
            values = list(value)
        else:
            values = [value]
        if not all(is_number(v) or (isinstance(v, torch.Tensor) and v.numel() == 1) for v in values):
            return False
        # No `no_grad` block (it costs more than the fill): the targets never require grad.
        for i, v in enumerate(values):
            target = self.tensors[i]
            if v is target:
                continue
            if isinstance(v, torch.Tensor):
                # Its value may have changed in place: copied on every sync, on the device.
                target.copy_(v.detach().reshape(()))
                self.filled[i] = _MISSING
            elif self.filled[i] is _MISSING or v != self.filled[i]:
                target.fill_(v)
                self.filled[i] = v
            self.versions[i] = target._version
        self._synced = value if all(is_number(v) for v in values) else _MISSING
        return True

    def read_back(self, given: Any) -> Any:
        """`given` again, or the values an eager step wrote into the tensors in place:
        read on the host (a synchronisation) only for a tensor something else wrote into
        since it was filled, which its version counter tells; never on the usual path."""
        values = list(given) if self.is_tuple else [given]
        changed = False
        for i, (t, v) in enumerate(zip(self.tensors, values, strict=True)):
            if t._version == self.versions[i]:
                continue
            self.versions[i] = t._version
            if is_number(v) and t.item() != torch.tensor(float(v), dtype=t.dtype).item():
                values[i] = t.item()
                self.filled[i] = values[i]
                self._synced = _MISSING
                changed = True
        if not changed:
            return given
        return type(given)(values) if self.is_tuple else values[0]


def _usable(t: torch.Tensor, device: torch.device) -> bool:
    return t.device == device and t.dtype == torch.float32 and t.dim() == 0 and not t.requires_grad


class HyperparamMirror:
    """The graph's view of one optimizer's hyper-parameters (see the module docstring)."""

    def __init__(self, optimizer: Optimizer, supports: list[KernelSupport], device: torch.device) -> None:
        self.optimizer = optimizer
        self.supports = supports
        self.device = device
        self.slots = [
            {k: _Slot(group[k], device) for k in support.tensor_keys}
            for group, support in zip(optimizer.param_groups, supports, strict=True)
        ]
        self._given: list[dict[str, Any]] | None = None
        self._attrs: dict[str, Any] = {}
        self._frozen: list[dict[str, Any]] | None = None
        # Per group, the keys a replay looks at and the objects they held at the last
        # replay that found nothing to do (None: look at everything next time).
        self._seen: list[tuple[tuple[str, ...], tuple[Any, ...]]] | None = None

    @property
    def installed(self) -> bool:
        return self._given is not None

    def matches_groups(self) -> bool:
        return len(self.optimizer.param_groups) == len(self.slots)

    def sync(self) -> list[HyperparamChange]:
        """Fill the tensors from the user's values; the changes that cannot be filled."""
        unapplied = []
        for i, (group, slots) in enumerate(zip(self.optimizer.param_groups, self.slots, strict=False)):
            for key, slot in slots.items():
                value = group.get(key)
                if not slot.sync(value):
                    unapplied.append(HyperparamChange(i, key, slot.packed, value, False))
        return unapplied

    def install(self) -> None:
        """Put the tensors and the graph-safe flags into the param groups."""
        assert self._given is None, "the graph-safe mode is already installed"
        self._given = []
        for group, slots, support in zip(self.optimizer.param_groups, self.slots, self.supports, strict=True):
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
        self._attrs = {k: getattr(self.optimizer, k, _MISSING) for k in wanted}
        for k, v in wanted.items():
            setattr(self.optimizer, k, v)

    def uninstall(self, *, read_back: bool = False) -> None:
        """Give the param groups back their own values. A value the step assigned
        meanwhile is kept; with `read_back`, so is one it wrote into a mirror tensor."""
        if self._given is None:
            return
        for group, given, slots in zip(self.optimizer.param_groups, self._given, self.slots, strict=True):
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
        self._given = None
        self._attrs = {}

    def freeze(self) -> None:
        """Remember the values the graph holds as Python numbers (at capture)."""
        self._seen = None
        self._frozen = [
            {k: group[k] for k in self._frozen_keys(group, slots, support)}
            for group, slots, support in zip(self.optimizer.param_groups, self.slots, self.supports, strict=True)
        ]

    def thaw(self) -> None:
        self._frozen = None
        self._seen = None

    def before_replay(self) -> list[HyperparamChange]:
        """`sync()` then `frozen_changes()`. In the usual replay no key of any group was
        assigned since the last one: the same objects as then, seen by one identity pass
        per group in C, and nothing else to do."""
        groups = self.optimizer.param_groups
        seen = self._seen
        if seen is None or len(groups) != len(seen):
            return self._full_pass()
        for i, (group, (keys, values)) in enumerate(zip(groups, seen, strict=True)):
            if not all(map(is_, map(group.get, keys), values)) and not self._follow(i, group, keys, values):
                return self._full_pass()
        return []

    def _full_pass(self) -> list[HyperparamChange]:
        changes = self.sync() + self.frozen_changes()
        self._seen = None if changes else self._snapshot()
        return changes

    def _follow(self, i: int, group: dict[str, Any], keys: tuple[str, ...], values: tuple[Any, ...]) -> bool:
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
            if slot is None:
                if not _same(frozen.get(key, _MISSING), after):
                    return False
            elif not slot.sync(after) or slot._synced is _MISSING:
                return False
        self._seen[i] = (keys, now)
        return True

    def _snapshot(self) -> list[tuple[tuple[str, ...], tuple[Any, ...]]] | None:
        if self._frozen is None or any(s._synced is _MISSING for slots in self.slots for s in slots.values()):
            return None  # a tensor value is copied on every sync: it may change in place
        snap = []
        for group, slots, frozen in zip(self.optimizer.param_groups, self.slots, self._frozen, strict=True):
            keys = (*slots, *frozen)
            snap.append((keys, tuple(map(group.get, keys))))
        return snap

    def frozen_changes(self) -> list[HyperparamChange]:
        """Frozen hyper-parameters that differ from their value at capture."""
        if self._frozen is None:
            return []
        groups = self.optimizer.param_groups
        if len(groups) != len(self._frozen):
            return [HyperparamChange(-1, "param_groups", len(self._frozen), len(groups), False)]
        changes = []
        for i, (group, frozen) in enumerate(zip(groups, self._frozen, strict=True)):
            for key, before in frozen.items():
                after = group.get(key, _MISSING)
                if after is not before and not _same(before, after):
                    changes.append(HyperparamChange(i, key, before, after, False))
        return changes

    def _frozen_keys(self, group: dict[str, Any], slots: dict[str, _Slot], support: KernelSupport) -> list[str]:
        # The flags the graph-safe mode sets are the same in every step it runs, whatever
        # the user's (or a loaded checkpoint's) own values are; a value only the first
        # step reads (captures come after it) no step after it reads either.
        skip = {*slots, *dict(support.flags), *support.first_step_only}
        return [k for k in hyperparameter_keys(self.optimizer, group) if k not in skip]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False
