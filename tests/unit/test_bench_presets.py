"""Bench presets (`--model hf-gpt2,hf-llama,timm-vit,tv-resnet50`): resolution, the error
for a library that is not installed, and the transformers models built small on CPU.

timm and torchvision do not import on the CPU test machine; their presets are built on
the GPU (tests/gpu/test_presets_gpu.py). A missing package is simulated by putting None
in `sys.modules`, which makes `import` raise ImportError as for an absent package.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from bench_args import parse
from ddpgraph import Code, DdpGraphUsageError
from ddpgraph.app.models import Workload
from ddpgraph.bench import command
from ddpgraph.bench.choice import parse_batch_sizes
from ddpgraph.bench.presets import LLAMA, PRESETS, CausalLMLogits, hf_gpt2, hf_llama
from ddpgraph.bench.workloads import resolve_model

CPU = torch.device("cpu")
# Small enough to train a step on two loaded CPU cores in well under a second.
TINY_GPT2 = {
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 2,
    "vocab_size": 96,
    "n_positions": 32,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
TINY_LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
}


def test_every_preset_names_its_package() -> None:
    assert {n: p.package for n, p in PRESETS.items()} == {
        "hf-gpt2": "transformers",
        "hf-llama": "transformers",
        "timm-vit": "timm",
        "tv-resnet50": "torchvision",
        "hf-bert": "transformers",
        "hf-moe": "transformers",
        "hf-moe-bf16": "transformers",
        "tv-syncbn": "torchvision",
        "hf-gpt2-ckpt": "transformers",
    }


@pytest.mark.parametrize("name", list(PRESETS))
def test_a_missing_package_is_a_usage_error_naming_it(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = PRESETS[name].package
    monkeypatch.setitem(sys.modules, package, None)  # `import package` now raises
    with pytest.raises(DdpGraphUsageError) as info:
        resolve_model(name)
    assert info.value.code is Code.INVALID_ARGUMENT
    message = str(info.value)
    assert f"`--model {name}`" in message and f"`{package}`" in message
    assert f"pip install {package}" in message and "HINT:" in message


def test_the_command_exits_2_before_any_worker_when_the_package_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "timm", None)
    argv = ["--model", "gpt,timm-vit"]
    assert command.main(parse(*argv), argv) == 2
    err = capsys.readouterr().err
    assert "[INVALID_ARGUMENT] `--model timm-vit`" in err and "`timm`" in err


def test_an_unknown_name_lists_the_presets() -> None:
    with pytest.raises(DdpGraphUsageError) as info:
        resolve_model("hf-t5")
    assert "hf-gpt2, hf-llama, timm-vit, tv-resnet50, hf-bert" in str(info.value)


def test_transformers_presets_resolve_at_their_published_sizes() -> None:
    pytest.importorskip("transformers")
    gpt2, llama = resolve_model("hf-gpt2"), resolve_model("hf-llama")
    assert (gpt2.name, gpt2.workload.unit, gpt2.workload.per_sample) == ("hf-gpt2", "tokens", 256)
    assert (llama.name, llama.workload.unit, llama.workload.per_sample) == (
        "hf-llama",
        "tokens",
        256,
    )
    x, y = gpt2.workload.make_batch(2, torch.Generator().manual_seed(0), CPU)
    assert x.shape == y.shape == (2, 256) and int(x.max()) < 50257  # GPT2Config's vocabulary
    x, _ = llama.workload.make_batch(2, torch.Generator().manual_seed(0), CPU)
    assert int(x.max()) < LLAMA["vocab_size"]
    batch_sizes = parse_batch_sizes(["hf-gpt2=8", "hf-llama=8,32"], [gpt2, llama])
    assert batch_sizes == {"hf-gpt2": [8], "hf-llama": [8, 32]}


@pytest.mark.parametrize(
    ("make", "config"), [(hf_gpt2, TINY_GPT2), (hf_llama, TINY_LLAMA)], ids=["gpt2", "llama"]
)
def test_transformers_models_build_and_train_a_step_on_cpu(
    make: Callable[..., Workload], config: dict[str, Any]
) -> None:
    pytest.importorskip("transformers")
    workload = make(seq_len=16, **config)
    torch.manual_seed(0)
    model = workload.build()
    torch.manual_seed(0)
    again = workload.build()
    assert isinstance(model, CausalLMLogits)
    assert model.model.config._attn_implementation == "sdpa"  # eager attention syncs the host
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)
    )
    x, y = workload.make_batch(3, torch.Generator().manual_seed(0), CPU)
    logits = model(x)
    assert logits.shape == (3, 16, config["vocab_size"])
    loss = workload.loss(logits, y)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_the_families_resolve_with_their_batches() -> None:
    # Built on the GPU (tests/gpu/test_families_gpu.py) and small on CPU processes
    # (tests/dist/test_families_gloo.py); here the names, units and batches.
    pytest.importorskip("transformers")
    from ddpgraph.bench.family_presets import MASK_ID, PAD_ID

    bert = resolve_model("hf-bert").workload
    x, y = bert.make_batch(4, torch.Generator().manual_seed(0), CPU)
    assert (bert.name, bert.per_sample, x.shape) == ("hf-bert", 128, (4, 128))
    padded, masked = x == PAD_ID, y != -100
    assert padded.any() and not padded[:, 0].any()  # every sequence has words, some are padded
    assert (
        bool((x[masked] == MASK_ID).all()) and not masked[padded].any()
    )  # labels only where a word was hidden
    for name in ("hf-moe", "hf-moe-bf16", "hf-gpt2-ckpt"):
        workload = resolve_model(name).workload
        assert (workload.name, workload.unit, workload.per_sample) == (name, "tokens", 256)
