"""Benchmark presets: models people train, built from their libraries' configurations.

    ddpgraph bench --model hf-gpt2,hf-llama,timm-vit,tv-resnet50

Each preset makes a randomly initialised model from a configuration, so nothing is
downloaded, with the library that defines it:

* `hf-gpt2`: transformers `GPT2Config()` (GPT-2 124M), sequences of 256 tokens;
* `hf-llama`: a transformers Llama, hidden size 512, 8 layers, 8 attention heads sharing
  4 key/value heads, vocabulary 32000, sequences of 256 tokens;
* `timm-vit`: `timm.create_model("vit_small_patch16_224", pretrained=False)`, 224² images;
* `tv-resnet50`: `torchvision.models.resnet50(weights=None)`, 224² images;
* `hf-bert`, `hf-moe`, `hf-moe-bf16`, `tv-syncbn`, `hf-gpt2-ckpt`: the families of
  `family_presets`.

Both transformers models use PyTorch's `scaled_dot_product_attention`
(`attn_implementation="sdpa"`): the "eager" attention of transformers synchronises with
the host inside forward, which no CUDA graph can hold. A preset whose library is not
installed is a usage error naming the package, raised before any worker starts.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..app.models import GPTConfig, Workload, cnn_workload, gpt_workload
from . import family_presets
from .names import PRESET_PACKAGES, preset_unavailable
from .preset_shapes import IMAGE_SIZE, IMAGENET_CLASSES, SEQ_LEN, CausalLMLogits

# The Llama of the presets; intermediate_size is 3× the hidden size, the ratio of
# Llama's SwiGLU blocks (LlamaConfig's default of 11008 suits hidden size 4096).
LLAMA: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
}


def hf_gpt2(seq_len: int = SEQ_LEN, **config: Any) -> Workload:
    """GPT-2 from its `GPT2Config(**config)` (124M by default), made through the auto
    classes (`AutoConfig.for_model("gpt2", ...)`)."""
    from transformers.models.auto import AutoConfig

    cfg = AutoConfig.for_model("gpt2", **{"attn_implementation": "sdpa", **config})
    return _causal_lm("hf-gpt2", cfg, seq_len)


def hf_llama(seq_len: int = SEQ_LEN, **config: Any) -> Workload:
    """A Llama from its `LlamaConfig` (through `AutoConfig`): `LLAMA`, updated by `config`."""
    from transformers.models.auto import AutoConfig

    merged = {**LLAMA, "attn_implementation": "sdpa", **config}
    return _causal_lm("hf-llama", AutoConfig.for_model("llama", **merged), seq_len)


def _causal_lm(name: str, config: Any, seq_len: int) -> Workload:
    from transformers.models.auto import AutoModelForCausalLM

    def build() -> nn.Module:
        return CausalLMLogits(AutoModelForCausalLM.from_config(config))

    # The built-in GPT's batches (a learnable next-token task) at this vocabulary.
    tokens = gpt_workload(GPTConfig(vocab=config.vocab_size, block=seq_len))
    return Workload(name, build, tokens.make_batch, tokens.loss, "tokens", seq_len)


def timm_vit() -> Workload:
    import timm

    return _image_classifier(
        "timm-vit", lambda: timm.create_model("vit_small_patch16_224", pretrained=False)
    )


def tv_resnet50() -> Workload:
    from torchvision.models import resnet50

    return _image_classifier("tv-resnet50", lambda: resnet50(weights=None))


def _image_classifier(name: str, build: Callable[[], nn.Module]) -> Workload:
    images = cnn_workload(image=IMAGE_SIZE, classes=IMAGENET_CLASSES)
    return Workload(name, build, images.make_batch, images.loss, "images")


@dataclass(frozen=True)
class Preset:
    """A preset's name, the package it is built with, and how."""

    name: str
    package: str
    make: Callable[[], Workload]


def _family(builder: str) -> Callable[[], Workload]:
    """A builder of `family_presets` (BERT, mixture of experts, SyncBatchNorm, activation
    checkpointing)."""

    def make() -> Workload:
        made: Workload = getattr(family_presets, builder)()
        return made

    return make


# What builds each preset; `names.PRESET_PACKAGES` has their order and their libraries.
_MAKERS: dict[str, Callable[[], Workload]] = {
    "hf-gpt2": hf_gpt2,
    "hf-llama": hf_llama,
    "timm-vit": timm_vit,
    "tv-resnet50": tv_resnet50,
    "hf-bert": _family("hf_bert"),
    "hf-moe": _family("hf_moe"),
    "hf-moe-bf16": _family("hf_moe_bf16"),
    "tv-syncbn": _family("tv_syncbn"),
    "hf-gpt2-ckpt": _family("hf_gpt2_ckpt"),
}
PRESETS: dict[str, Preset] = {
    name: Preset(name, package, _MAKERS[name]) for name, package in PRESET_PACKAGES.items()
}


def preset_workload(name: str) -> Workload:
    """The preset's workload; a usage error naming the package when it cannot be imported."""
    preset = PRESETS[name]
    try:
        importlib.import_module(preset.package)
    except Exception as err:  # absent, or a build that does not match this torch
        raise preset_unavailable(name, preset.package, f"{type(err).__name__}: {err}") from err
    return preset.make()
