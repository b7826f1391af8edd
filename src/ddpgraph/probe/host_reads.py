"""What reads tensor data on the host: the operations a CUDA graph cannot record.

On a GPU, an operation that makes the host wait for a kernel's result (`.item()`,
`float(t)`, `if t:`, `.tolist()`, printing a tensor, `.cpu()`, `torch.nonzero`, a
boolean mask) cannot be recorded: CUDA fails the capture with "operation not permitted
when stream is capturing". On CPU nothing waits, so the same step records happily. The
recording backend (`backends/recording.py`) refuses these operations while it records, raising
the error CUDA raises, so that `diagnose.py` names the cause and the user's line the
same way on both.

Two levels see them. Most reach the dispatcher as an aten operation
(`aten._local_scalar_dense` behind `.item()`, `float()`, `bool()`; `aten.nonzero`;
`aten.index.Tensor` with a boolean index). A few read the data in C++ without going
through the dispatcher (`.tolist()`, `.numpy()`, printing): those are seen as tensor
methods by a `TorchFunctionMode`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .library_settings import known_setting

# The text CUDA raises for an operation a capture cannot record (cudaErrorStreamCaptureUnsupported);
# `diagnose.py` recognises it.
CAPTURE_UNSUPPORTED = "operation not permitted when stream is capturing"

# aten operations whose result needs tensor data on the host: a scalar read, or an
# output whose size depends on the data.
_HOST_READ_OPS = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::nonzero",
        "aten::nonzero_numpy",
        "aten::masked_select",
        "aten::equal",
        "aten::_unique",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::unique_dim_consecutive",
        "aten::bincount",
    }
)
# Indexing with a boolean (or byte) mask computes `nonzero` of the mask.
_MASK_INDEX_OPS = frozenset(
    {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
)
_MASK_DTYPES = (torch.bool, torch.uint8)

# Tensor methods that read data in C++ without a dispatcher call.
_HOST_READ_METHODS = {
    torch.Tensor.tolist: "`Tensor.tolist()`",
    torch.Tensor.numpy: "`Tensor.numpy()`",
    torch.Tensor.__array__: "converting a tensor to a NumPy array",
    torch.Tensor.__repr__: "printing a tensor",
    torch.Tensor.__str__: "printing a tensor",
    torch.Tensor.__format__: "formatting a tensor",
    torch.Tensor.cpu: "`Tensor.cpu()` (a device-to-host copy on a GPU)",
}


class HostReadInCapture(RuntimeError):
    """Raised while recording by an operation that reads tensor data on the host;
    `setting` is the fix a known setting of the library that read offers, if any
    (`library_settings`, from the modules running at the read, as the GPU probe finds it)."""

    def __init__(self, message: str, setting: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting


def tensors_in(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    """The tensors in `values`, looking inside (nested) lists and tuples."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from tensors_in(value)


def op_host_read(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """What an aten operation reads on the host (a description), or None."""
    name = func._schema.name
    if name in _HOST_READ_OPS:
        return f"`{func}`"
    if (
        name == "aten::repeat_interleave"
        and kwargs.get("output_size") is None
        and func._overloadname != "self_int"
    ):
        return f"`{func}` without `output_size`"
    if name in _MASK_INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(
            t.dtype in _MASK_DTYPES for t in tensors_in(indices or ())
        ) and not _becomes_masked_fill(name, args, kwargs):
            return f"`{func}` with a boolean mask (it computes `nonzero` of the mask)"
    return None


def _becomes_masked_fill(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """`t[mask] = 0.0`: PyTorch runs an assignment of one host value through one mask on
    the tensor's device as `masked_fill_`, which reads nothing on the host."""
    if name == "aten::index" or len(args) < 3:
        return False
    self, indices, value = args[0], args[1], args[2]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if (
        accumulate
        or not isinstance(value, torch.Tensor)
        or value.numel() != 1
        or value.device.type != "cpu"
    ):
        return False
    given = [t for t in (indices or ()) if t is not None]
    return len(given) == 1 and given[0].dtype in _MASK_DTYPES and given[0].device == self.device


def method_host_read(func: Any) -> str | None:
    """What a tensor method seen by a `TorchFunctionMode` reads on the host, or None."""
    try:
        return _HOST_READ_METHODS.get(func)
    except TypeError:  # an unhashable callable
        return None


def host_read_error(what: str) -> HostReadInCapture:
    return HostReadInCapture(
        f"{CAPTURE_UNSUPPORTED}: {what} reads tensor data on the host while the step is being "
        "recorded (ddpgraph's CPU recording backend refuses what a CUDA graph capture refuses)",
        known_setting(sys._getframe(1)),
    )


class HostReadWatch(TorchDispatchMode):
    """Notes, without refusing them, the aten operations run inside it that read tensor
    data on the host (`reads`): what the recording backend would refuse. Used to probe a
    CPU optimizer kernel before any step is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        what = op_host_read(func, args, kwargs)
        if what is not None:
            self.reads.append(what)
        return func(*args, **kwargs)
