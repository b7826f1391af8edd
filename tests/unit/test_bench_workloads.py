"""`--model` and `--batch-sizes`: built-in names, the factory contract, and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddpgraph import Code, DdpGraphUsageError
from ddpgraph.bench.choice import parse_batch_sizes, resolve_models
from ddpgraph.bench.workloads import resolve_model

MODELS = Path(__file__).parent.parent / "scenarios" / "bench_models.py"


def spec(factory: str) -> str:
    return f"{MODELS}:{factory}"


def usage_error(text: str) -> str:
    with pytest.raises(DdpGraphUsageError) as info:
        resolve_model(text)
    assert info.value.code is Code.INVALID_ARGUMENT
    message = str(info.value)
    assert "HINT:" in message
    return message


def test_builtin_names() -> None:
    for name in ("gpt", "mlp", "resnet18"):
        model = resolve_model(name)
        assert model.name == name and model.spec == name


def test_factory_returning_a_workload() -> None:
    model = resolve_model(spec("tiny"))
    assert model.name == "tiny"
    x, y = model.workload.make_batch(3, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert x.shape == (3, 16) and y.shape == (3,)


def test_factory_returning_a_tuple_builds_a_fresh_model_each_time() -> None:
    model = resolve_model(spec("tiny_tuple"))
    assert model.name == spec("tiny_tuple")
    torch.manual_seed(0)
    first = model.workload.build()
    torch.manual_seed(0)
    second = model.workload.build()
    assert first is not second
    assert all(
        torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters(), strict=True)
    )


def test_importable_module_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(MODELS.parent))
    assert resolve_model("bench_models:tiny").name == "tiny"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "gtp",
            "expected one of gpt, mlp, resnet18, hf-gpt2, hf-llama, timm-vit, tv-resnet50, "
            "hf-bert, hf-moe, hf-moe-bf16, tv-syncbn, hf-gpt2-ckpt or MODULE:FACTORY, got 'gtp'",
        ),
        (":tiny", "expected MODULE:FACTORY with both parts"),
        ("no_such_module_here:make", "could not import `no_such_module_here`: ModuleNotFoundError"),
        ("/nowhere/models.py:make", "could not import `/nowhere/models.py`: FileNotFoundError"),
    ],
)
def test_spec_errors(text: str, expected: str) -> None:
    message = usage_error(text)
    assert "[INVALID_ARGUMENT] `--model" in message
    assert expected in message


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        ("missing", "has no attribute `missing`"),
        ("not_callable", "expected `not_callable` to be a callable factory, got int"),
        (
            "wrong_return",
            "expected the factory to return a Workload or (model, loss, make_batch), got list of 2",
        ),
        ("wrong_model", "expected the first item to be a torch.nn.Module, got str"),
        ("raises", "calling the factory raised ValueError: factory exploded"),
        ("bad_batch", "expected `make_batch` to return (inputs, targets) tensors, got Tensor"),
    ],
)
def test_factory_contract_errors(factory: str, expected: str) -> None:
    message = usage_error(spec(factory))
    assert expected in message
    assert "the factory takes no arguments and returns a `ddpgraph.app.models.Workload`" in message


def test_each_model_once() -> None:
    with pytest.raises(DdpGraphUsageError, match="got gpt more than once"):
        resolve_models(["gpt", "mlp", "gpt"])


def test_batch_sizes_default_per_model() -> None:
    models = resolve_models(["gpt", "resnet18", spec("tiny")])
    assert parse_batch_sizes(None, models) == {
        "gpt": [8, 32],
        "resnet18": [32, 128],
        "tiny": [8, 32],
    }


def test_batch_sizes_for_all_then_per_model() -> None:
    models = resolve_models(["gpt", "resnet18"])
    assert parse_batch_sizes(["4,2,4"], models) == {"gpt": [2, 4], "resnet18": [2, 4]}
    assert parse_batch_sizes(["gpt=8,32", "resnet18=32,128"], models) == {
        "gpt": [8, 32],
        "resnet18": [32, 128],
    }
    assert parse_batch_sizes(["16", "gpt=8"], models) == {"gpt": [8], "resnet18": [16]}


def test_batch_sizes_by_factory_spec() -> None:
    models = resolve_models([spec("tiny_tuple")])
    assert parse_batch_sizes([f"{spec('tiny_tuple')}=3"], models) == {spec("tiny_tuple"): [3]}


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("8,x", "expected positive integers like `8,32` or `gpt=8,32`, got '8,x'"),
        ("0", "got '0'"),
        ("gpt=", "got 'gpt='"),
        ("bert=8", "names model 'bert', which is not among --model (gpt)"),
    ],
)
def test_batch_size_errors(entry: str, expected: str) -> None:
    with pytest.raises(DdpGraphUsageError) as info:
        parse_batch_sizes([entry], resolve_models(["gpt"]))
    assert expected in str(info.value)
    assert str(info.value).startswith("[INVALID_ARGUMENT] `--batch-sizes`")
