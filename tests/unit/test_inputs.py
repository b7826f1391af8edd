"""Call signatures, the check for arguments ddpgraph cannot see into, static input buffers."""

from __future__ import annotations

import enum
from typing import Any

import pytest
import torch

from ddpgraph import Code, DdpGraphUsageError
from ddpgraph.inputs.arguments import (
    Signature,
    StaticInputs,
    check_supported,
    flatten_call,
    leaf_paths,
    stage_leaves,
)


def _sig(*args: Any, **kwargs: Any) -> Signature:
    leaves, spec = flatten_call(args, kwargs)
    return Signature(leaves, spec, leaf_paths(args, kwargs))


def _matches(sig: Signature, *args: Any, **kwargs: Any) -> bool:
    return sig.matches(*flatten_call(args, kwargs))


class Mode(enum.Enum):
    TRAIN = 1
    EVAL = 2


X = torch.zeros(8, 16)
Y = torch.zeros(8, dtype=torch.long)


def test_same_call_matches() -> None:
    sig = _sig(X, {"y": Y, "w": [X, 3]}, scale=0.5, mode=Mode.TRAIN, name="a", dt=torch.float32)
    assert _matches(
        sig,
        torch.ones(8, 16),
        {"y": Y + 1, "w": [X, 3]},
        scale=0.5,
        mode=Mode.TRAIN,
        name="a",
        dt=torch.float32,
    )
    assert sig.describe_change(
        (X, {"y": Y, "w": [X, 3]}),
        {"scale": 0.5, "mode": Mode.TRAIN, "name": "a", "dt": torch.float32},
    ) == ("the arguments are unchanged")


@pytest.mark.parametrize(
    ("new", "words"),
    [
        (torch.zeros(5, 16), ["`args[0]`", "(8, 16) float32 on cpu", "(5, 16) float32 on cpu"]),
        (torch.zeros(8, 16, dtype=torch.float64), ["`args[0]`", "float32", "float64"]),
        (torch.zeros(8, 16, device="meta"), ["`args[0]`", "on cpu", "on meta"]),
        (torch.zeros(8, 16, requires_grad=True), ["`args[0]`", "requires_grad"]),
        (torch.zeros(8, 15), ["`args[0]`", "(8, 15)"]),
        (torch.zeros(8, 16, 1), ["`args[0]`", "(8, 16, 1)"]),
    ],
    ids=["batch", "dtype", "device", "requires_grad", "width", "rank"],
)
def test_tensor_change_is_a_mismatch_naming_the_input(new: torch.Tensor, words: list[str]) -> None:
    sig = _sig(X, Y)
    assert not _matches(sig, new, Y)
    text = sig.describe_change((new, Y), {})
    for word in words:
        assert word in text, text


def test_kwarg_change_names_the_keyword_and_both_shapes() -> None:
    sig = _sig(x=X, y=Y)
    assert not _matches(sig, x=torch.zeros(4, 16), y=Y)
    text = sig.describe_change((), {"x": torch.zeros(4, 16), "y": Y})
    assert "`kwargs['x']`" in text
    assert "(8, 16)" in text and "(4, 16)" in text


def test_nested_input_is_named_by_its_path() -> None:
    sig = _sig({"batch": [X, Y]})
    new = {"batch": [X, torch.zeros(3, dtype=torch.long)]}
    assert not _matches(sig, new)
    assert "`args[0]['batch'][1]`" in sig.describe_change((new,), {})


@pytest.mark.parametrize(
    ("captured", "called"),
    [
        ((X, Y), (X,)),  # fewer arguments
        ((X, Y), (X, Y, Y)),  # more
        (([X, Y],), ((X, Y),)),  # list became tuple
        (({"a": X},), ({"b": X},)),  # another key
    ],
    ids=["fewer", "more", "list-to-tuple", "dict-key"],
)
def test_structure_change_is_a_mismatch(captured: tuple[Any, ...], called: tuple[Any, ...]) -> None:
    sig = _sig(*captured)
    assert not _matches(sig, *called)
    text = sig.describe_change(called, {})
    assert "structure of the arguments changed" in text
    assert "_FlatTensors" not in text  # no internals in a user's message


def test_keyword_moved_to_positional_is_a_mismatch() -> None:
    sig = _sig(X, y=Y)
    assert not _matches(sig, X, Y)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (3, 4),
        (0.5, 0.25),
        ("train", "eval"),
        (True, False),
        (1, True),
        (1, 1.0),
        (None, 0),
        (Mode.TRAIN, Mode.EVAL),
    ],
)
def test_non_tensor_constant_change_is_a_mismatch(before: Any, after: Any) -> None:
    sig = _sig(X, before)
    assert _matches(sig, X, before)
    assert not _matches(sig, X, after)
    assert (
        sig.describe_change((X, after), {})
        == f"argument `args[1]` changed from {before!r} to {after!r}"
    )


def test_tensor_replaced_by_a_number_is_a_mismatch() -> None:
    sig = _sig(X, Y)
    assert not _matches(sig, X, 3)
    text = sig.describe_change((X, 3), {})
    assert "`args[1]`" in text and "int 3" in text


def test_leaf_paths() -> None:
    assert leaf_paths((X, [Y, {"k": 1}]), {"z": (X,)}) == [
        "args[0]",
        "args[1][0]",
        "args[1][1]['k']",
        "kwargs['z'][0]",
    ]


class Batch:
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


def test_check_supported_refuses_unknown_objects() -> None:
    with pytest.raises(DdpGraphUsageError) as info:
        check_supported((X, Batch(X)), {})
    assert info.value.code is Code.UNSUPPORTED_INPUT
    text = str(info.value)
    assert "`args[1]`" in text and "Batch" in text and "HINT:" in text


def test_check_supported_names_a_nested_keyword() -> None:
    with pytest.raises(DdpGraphUsageError, match=r"`kwargs\['batch'\]\[0\]` is a Batch"):
        check_supported((), {"batch": [Batch(X)]})


def test_check_supported_accepts_tensors_numbers_and_containers() -> None:
    check_supported(
        (X, [Y, (1, 2.0, 3j)], {"s": "a", "b": b"x"}),
        {
            "none": None,
            "dt": torch.float16,
            "dev": torch.device("cpu"),
            "size": torch.Size([2]),
            "mode": Mode.EVAL,
            "sl": slice(1, 2),
            "e": ...,
            "flag": True,
        },
    )


def test_static_inputs_copy_in_writes_values_and_keeps_the_buffers() -> None:
    x, y = torch.randn(4, 3), torch.arange(4)
    leaves, spec = flatten_call((x,), {"y": y, "k": 7})
    static = StaticInputs(leaves, spec, torch.device("cpu"))
    args, kwargs = static.call_args()
    buf_x, buf_y = args[0], kwargs["y"]
    assert buf_x is not x and buf_y is not y  # copies: the caller may reuse its tensors
    assert torch.equal(buf_x, x) and torch.equal(buf_y, y)
    assert kwargs["k"] == 7

    x2, y2 = torch.randn(4, 3), torch.arange(4) * 3
    static.copy_in(flatten_call((x2,), {"y": y2, "k": 7})[0])
    args2, kwargs2 = static.call_args()
    assert args2[0] is buf_x and kwargs2["y"] is buf_y  # the graph reads these addresses
    assert buf_x.data_ptr() == args[0].data_ptr()
    assert torch.equal(buf_x, x2) and torch.equal(buf_y, y2)
    x2.add_(1)  # later changes of the caller's tensor do not reach the buffer
    assert not torch.equal(buf_x, x2)


def test_static_inputs_keep_requires_grad() -> None:
    x = torch.randn(2, 2, requires_grad=True)
    static = StaticInputs(*flatten_call((x,), {}), None)
    (buf,), _ = static.call_args()
    assert buf.requires_grad and buf.is_leaf


def test_stage_leaves_is_a_no_op_off_cuda() -> None:
    leaves = [X, 3]
    assert stage_leaves(leaves, torch.device("cpu")) is leaves
    assert stage_leaves(leaves, None) is leaves


def test_leaves_are_named_by_the_steps_parameters_where_they_bind() -> None:
    from ddpgraph.inputs.arguments import leaf_paths

    x, y = torch.zeros(2), torch.zeros(2)

    def step(x: torch.Tensor, batch: tuple[torch.Tensor, ...], i: int, *rest: Any, **kw: Any):
        return x

    args, kwargs = (x, (x, y), 3, y), {"scale": 1.0, "extra": {"m": y}}
    assert leaf_paths(args, kwargs, step) == [
        "x", "batch[0]", "batch[1]", "i", "args[3]", "scale", "extra['m']",
    ]  # fmt: skip
    # Without the function (or one without a signature), the positions.
    assert leaf_paths(args, kwargs)[:4] == ["args[0]", "args[1][0]", "args[1][1]", "args[2]"]
    assert leaf_paths((x,), {}, print)[0] == "args[0]"
