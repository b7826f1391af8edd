"""What a replay assumes about the model's parameters, checked before each replay.

A graph reads and writes the parameter storage it was recorded with, and computes a
gradient for every parameter that required one. Seen before the next replay, at the
cost of two passes over the parameter list in C (`map`, or one C++ call for the
pointers where the build has it), no Python loop:

* a parameter whose storage moved: `param.data = ...`, `model.half()`, `.to(dtype)`,
  `load_state_dict(..., assign=True)` (the graph would write freed memory);
* a parameter whose `requires_grad` changed (`requires_grad_(False)` to freeze layers:
  the graph would keep updating them).

A parameter replaced by a new `nn.Parameter` object in its module is seen when it
happens through the module's `load_state_dict` (its load hook asks `replaced`); done by
hand (`module.weight = nn.Parameter(...)`) it is not seen.
"""

from __future__ import annotations

from operator import attrgetter

import torch
from torch import nn

from ..agreement.agree import Action
from ..cycle.step_state import Report
from ..findings import Code, Finding

_requires_grad = attrgetter("requires_grad")
# The C method itself: `torch.Tensor.data_ptr` adds a Python-level lookup per call.
_data_ptr = (
    torch._C.TensorBase.data_ptr if hasattr(torch._C, "TensorBase") else torch.Tensor.data_ptr
)
# CUDA builds compare a whole list of pointers in one C++ call (what inductor's graph
# trees check their static inputs with); elsewhere, one map over the parameters.
_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


class ParamLayout:
    def __init__(self, model: nn.Module) -> None:
        self._params = list(model.parameters())
        self._ptrs = list(map(_data_ptr, self._params))
        self._grads = list(map(_requires_grad, self._params))
        self._indices = list(range(len(self._params)))
        self._all_train = all(self._grads)

    def check(self) -> Report | None:
        if self._same_storage() and self._same_grads():
            return None
        return Report(self._describe(), Action.RECAPTURE)

    def _same_grads(self) -> bool:
        # Every parameter trained (the usual case): `all` over the flags, with no list built.
        if self._all_train:
            return all(map(_requires_grad, self._params))
        return list(map(_requires_grad, self._params)) == self._grads

    def _same_storage(self) -> bool:
        if _ptrs_equal is not None:
            return bool(_ptrs_equal(self._params, self._ptrs, self._indices))
        return list(map(_data_ptr, self._params)) == self._ptrs

    def replaced(self, model: nn.Module) -> Report | None:
        """After `model.load_state_dict`: whether it put new parameter objects in place."""
        now = list(model.parameters())
        if len(now) == len(self._params) and all(
            a is b for a, b in zip(now, self._params, strict=True)
        ):
            return None
        return Report(
            Finding(
                Code.PARAMETERS_CHANGED,
                "`load_state_dict` replaced the model's parameter tensors; the graph still "
                "uses the old ones, so it is dropped and the step is captured again",
                "load with `assign=False` (the default) to keep the capture",
                subject="`CapturedStep`",
            ),
            Action.RECAPTURE,
        )

    def _describe(self) -> Finding:
        for i, (p, ptr, grad) in enumerate(zip(self._params, self._ptrs, self._grads, strict=True)):
            if p.requires_grad != grad:
                what = f"parameter {i} ({tuple(p.shape)}) now has requires_grad={p.requires_grad}"
                break
            if p.data_ptr() != ptr:
                what = (
                    f"parameter {i} ({tuple(p.shape)}, {str(p.dtype).replace('torch.', '')}) "
                    "now lives in other storage"
                )
                break
        return Finding(
            Code.PARAMETERS_CHANGED,
            f"{what} since capture; the graph would train the captured layout, so it is "
            "dropped and the step is captured again",
            "expected after freezing layers or moving the model; to avoid the re-capture, make "
            "such changes before the first step",
            subject="`CapturedStep`",
        )
