"""What the benchmark presets share: the shapes of their batches and the wrapper that
makes a transformers causal language model return its logits."""

from __future__ import annotations

import torch
from torch import nn

SEQ_LEN = 256
IMAGE_SIZE = 224
IMAGENET_CLASSES = 1000


class CausalLMLogits(nn.Module):
    """A transformers causal language model called on token ids, returning the logits.

    The benchmark's loss takes a tensor; the model's output object, and the key/value
    cache a training step has no use for, stay inside.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits
