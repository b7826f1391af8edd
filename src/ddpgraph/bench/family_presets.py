"""Bench presets of the model families beyond the first four, each from its library's
configuration (nothing downloaded):

* `hf-bert`: a transformers BERT masked language model (6 layers, hidden size 512, 8
  heads, vocabulary 30522) on padded sequences of 128 tokens, with the attention mask
  of the padding; 15% of the real tokens masked;
* `hf-moe`: a transformers Mixtral mixture of experts (4 layers, hidden size 512, 8
  experts of which each token takes 2, vocabulary 32000), sequences of 256 tokens, with
  transformers' default experts implementation (`grouped_mm`: fixed shapes, the routing
  stays on the device); `hf-moe-bf16` the same with its weights in bf16, the only dtype
  for which PyTorch's CUDA grouped product does not read the group offsets on the host;
* `tv-syncbn`: torchvision's ResNet-18 with every BatchNorm converted to
  `torch.nn.SyncBatchNorm`, 224² images (with one process SyncBatchNorm computes as
  BatchNorm: there is no peer to share statistics with);
* `hf-gpt2-ckpt`: a transformers GPT-2 (6 layers, width 384, dropout 0.1), sequences of
  256 tokens, with activation checkpointing (`torch.utils.checkpoint`, non-reentrant).

Each builder takes the configuration's fields as keywords, which the CPU tests use to
build the same families small.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..app.models import GPTConfig, Workload, cnn_workload, gpt_workload
from .preset_shapes import IMAGE_SIZE, IMAGENET_CLASSES, SEQ_LEN, CausalLMLogits

BERT: dict[str, Any] = {
    "hidden_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "intermediate_size": 2048,
}
BERT_SEQ_LEN = 128
MIXTRAL: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
}
GPT2_CKPT: dict[str, Any] = {
    "n_layer": 6,
    "n_embd": 384,
    "n_head": 6,
    "vocab_size": 8192,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
# BERT's special tokens in its vocabulary: padding, and the mask that hides a token.
PAD_ID, MASK_ID, FIRST_WORD_ID = 0, 103, 1000
MASKED_SHARE = 0.15


class MaskedLMLogits(nn.Module):
    """A transformers masked language model called on padded token ids, with the
    attention mask of their padding, returning the logits."""

    def __init__(self, model: nn.Module, pad_id: int = PAD_ID) -> None:
        super().__init__()
        self.model = model
        self.pad_id = pad_id

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mask = input_ids.ne(self.pad_id).long()
        return self.model(input_ids=input_ids, attention_mask=mask).logits


def masked_lm_batches(
    vocab: int, seq_len: int
) -> Callable[[int, torch.Generator, torch.device], tuple[torch.Tensor, torch.Tensor]]:
    """Batches of a learnable masked-token task: arithmetic sequences of words, each of
    a length from half the sequence to all of it, padded; labels -100 where unmasked."""

    def batch(
        n: int, gen: torch.Generator, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        words = vocab - FIRST_WORD_ID
        start = torch.randint(0, words, (n, 1), generator=gen)
        step = torch.randint(1, 7, (n, 1), generator=gen)
        ids = (start + step * torch.arange(seq_len)) % words + FIRST_WORD_ID
        lengths = torch.randint(seq_len // 2, seq_len + 1, (n, 1), generator=gen)
        real = torch.arange(seq_len) < lengths
        masked = real & (torch.rand(n, seq_len, generator=gen) < MASKED_SHARE)
        masked[:, 0] = True  # at least one label per sequence
        labels = torch.where(masked, ids, -100)
        inputs = torch.where(masked, MASK_ID, torch.where(real, ids, PAD_ID))
        return inputs.to(device), labels.to(device)

    return batch


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100
    )


def hf_bert(seq_len: int = BERT_SEQ_LEN, **config: Any) -> Workload:
    from transformers.models.auto import AutoConfig, AutoModelForMaskedLM

    cfg = AutoConfig.for_model(
        "bert",
        **{
            **BERT,
            "attn_implementation": "sdpa",
            "max_position_embeddings": max(512, seq_len),
            **config,
        },
    )

    def build() -> nn.Module:
        return MaskedLMLogits(AutoModelForMaskedLM.from_config(cfg))

    return Workload(
        "hf-bert",
        build,
        masked_lm_batches(cfg.vocab_size, seq_len),
        masked_lm_loss,
        "tokens",
        seq_len,
    )


def hf_moe(seq_len: int = SEQ_LEN, *, dtype: torch.dtype | None = None, **config: Any) -> Workload:
    from transformers.models.auto import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("mixtral", **{**MIXTRAL, "attn_implementation": "sdpa", **config})

    def build() -> nn.Module:
        model = AutoModelForCausalLM.from_config(cfg)
        return CausalLMLogits(model if dtype is None else model.to(dtype))

    tokens = gpt_workload(GPTConfig(vocab=cfg.vocab_size, block=seq_len))
    name = (
        "hf-moe"
        if dtype is None
        else f"hf-moe-{str(dtype).removeprefix('torch.').replace('bfloat16', 'bf16')}"
    )
    return Workload(name, build, tokens.make_batch, tokens.loss, "tokens", seq_len)


def hf_moe_bf16() -> Workload:
    return hf_moe(dtype=torch.bfloat16)


def enable_checkpointing(model: nn.Module, *, reentrant: bool) -> None:
    """transformers' activation checkpointing, by the name this version gives it
    (`activation_checkpointing_enable`, earlier `gradient_checkpointing_enable`)."""
    for method, keyword in (
        ("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
        ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs"),
    ):
        enable = getattr(model, method, None)
        if callable(enable):
            enable(**{keyword: {"use_reentrant": reentrant}})
            return
    raise TypeError(f"{type(model).__name__} has no activation checkpointing to enable")


def hf_gpt2_ckpt(seq_len: int = SEQ_LEN, *, reentrant: bool = False, **config: Any) -> Workload:
    from transformers.models.auto import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "gpt2",
        **{**GPT2_CKPT, "attn_implementation": "sdpa", "n_positions": max(1024, seq_len), **config},
    )

    def build() -> nn.Module:
        model = AutoModelForCausalLM.from_config(cfg)
        enable_checkpointing(model, reentrant=reentrant)
        return CausalLMLogits(model)

    tokens = gpt_workload(GPTConfig(vocab=cfg.vocab_size, block=seq_len))
    name = "hf-gpt2-ckpt-reentrant" if reentrant else "hf-gpt2-ckpt"
    return Workload(name, build, tokens.make_batch, tokens.loss, "tokens", seq_len)


def sync_batch_norm(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """`build`, with every BatchNorm of the model converted to SyncBatchNorm."""
    return lambda: nn.SyncBatchNorm.convert_sync_batchnorm(build())


def tv_syncbn(image: int = IMAGE_SIZE) -> Workload:
    from torchvision.models import resnet18

    images = cnn_workload(image=image, classes=IMAGENET_CLASSES)
    return Workload(
        "tv-syncbn",
        sync_batch_norm(lambda: resnet18(weights=None)),
        images.make_batch,
        images.loss,
        "images",
    )
