"""One hyper-parameter of a param group kept as device tensors for a captured step:
filled from the user's value before each replay without a host read, and read back
after an eager step only where something wrote into it."""

from __future__ import annotations

from typing import Any

import torch

from .own_updates import is_number

_MISSING = object()


class HyperparamSlot:
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
        # The last value filled that holds only numbers and cannot change in place (not a
        # list): the same object again (the usual replay, where nothing assigned the
        # key) needs no look at all.
        self._synced: Any = _MISSING
        # The value holds a tensor, copied on every sync: it may change in place.
        self.has_tensor = False
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
        if not all(
            is_number(v) or (isinstance(v, torch.Tensor) and v.numel() == 1) for v in values
        ):
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
        self.has_tensor = any(isinstance(v, torch.Tensor) for v in values)
        immutable = not self.has_tensor and not isinstance(value, list)
        self._synced = value if immutable else _MISSING
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
