"""`prepare_ddp` infers DDP's `device_ids` from where the model lives, so the same line
works on one GPU per process and on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddpgraph
from ddpgraph.ddp.build import infer_device_ids
from ddpgraph.ddp.distributed import DistInfo

GPU1 = torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("devices", "given", "expected"),
    [
        ({GPU1}, None, [1]),  # one GPU per process: that GPU
        ({torch.device("cuda")}, None, [0]),  # "cuda" without an index is the first GPU
        ({torch.device("cpu")}, None, None),  # CPU: DDP wants none
        ({torch.device("cpu")}, [], None),
        ({torch.device("cuda", 0), GPU1}, None, None),  # spread over GPUs: none
        (set(), None, None),  # no parameters
        ({GPU1}, [1], [1]),  # given and usable: kept
    ],
)
def test_device_ids_follow_the_model(
    devices: set[torch.device], given: object, expected: list[int] | None
) -> None:
    assert infer_device_ids(devices, given) == expected


@pytest.mark.parametrize(
    ("devices", "given"),
    [
        ({torch.device("cpu")}, [None]),  # `[info.device.index]` on CPU
        ({torch.device("cpu")}, [0]),
        ({torch.device("cuda", 0), GPU1}, [0]),
        ({GPU1}, 1),
    ],
)
def test_unusable_device_ids_are_refused_with_the_fix(
    devices: set[torch.device], given: object
) -> None:
    with pytest.raises(ddpgraph.DdpGraphUsageError) as err:
        infer_device_ids(devices, given)
    text = str(err.value)
    assert text.startswith("[INVALID_ARGUMENT] `prepare_ddp(device_ids=...)`: expected")
    assert f"got {given!r}" in text and "HINT: leave `device_ids` out" in text


def test_cpu_model_needs_no_device_ids(process_group: DistInfo) -> None:
    ddp = ddpgraph.prepare_ddp(nn.Linear(4, 2))
    assert ddp.device_ids is None
    ddp(torch.randn(3, 4)).sum().backward()


def test_cpu_model_with_a_none_device_id_is_a_usage_error(process_group: DistInfo) -> None:
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="leave `device_ids` out"):
        ddpgraph.prepare_ddp(nn.Linear(4, 2), device_ids=[process_group.device.index])


def test_the_module_inside_ddp_and_its_group_are_read_in_one_place(process_group: object) -> None:
    from ddpgraph.ddp.build import inner_module, process_group_of

    plain = nn.Linear(2, 2)
    ddp = ddpgraph.prepare_ddp(nn.Linear(2, 2))
    assert inner_module(ddp) is ddp.module and inner_module(plain) is plain
    assert process_group_of(ddp) is ddp.process_group is not None
    assert process_group_of(plain) is None


def test_graphs_are_possible_only_for_a_cuda_device_with_cuda_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ddpgraph.ddp.streams import can_run_graphs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert can_run_graphs(torch.device("cuda", 0)) and not can_run_graphs(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not can_run_graphs(torch.device("cuda", 0))
