"""The variable-sequence-length case's data (`varlen_plan` holds its arguments): each
rank's per-step lengths, its batches cut to them and padded to the buckets, and the
models built again to hold the longest length.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..app.models import CPU_GPT_CONFIG, GPTConfig, gpt_workload
from ..family.buckets import pad_to_bucket
from .feeds import DATA_SEED, Batch
from .presets import hf_gpt2, hf_llama
from .varlen_plan import LENGTHS_SEED, VarLen
from .workloads import ModelSpec

# The presets built again at the longest length (`names.KNOWN_MODELS` has their `longest`).
_RESIZABLE = {"hf-gpt2": hf_gpt2, "hf-llama": hf_llama}


def sized(model: ModelSpec, high: int, *, cpu_sized: bool) -> ModelSpec:
    """The workload that trains sequences of `high` tokens: the built-in GPT and the
    resizable presets built again for them, any other model as it is (the arguments are
    checked already: `varlen_plan.check_sized`)."""
    if model.spec == "gpt":
        config = CPU_GPT_CONFIG if cpu_sized else GPTConfig()
        return ModelSpec(model.spec, gpt_workload(replace(config, block=high)))
    if model.spec in _RESIZABLE:
        return ModelSpec(model.spec, _RESIZABLE[model.spec](seq_len=high))
    return model


def step_lengths(varlen: VarLen, count: int, rank: int) -> list[int]:
    """The per-step lengths of this rank: the same for every row."""
    gen = torch.Generator().manual_seed(LENGTHS_SEED + rank)
    return [int(t) for t in torch.randint(varlen.low, varlen.high + 1, (count,), generator=gen)]


def varlen_batches(model: ModelSpec, batch_size: int, lengths: list[int], rank: int) -> list[Batch]:
    """One host batch per length: the workload's batch cut to that length."""
    gen = torch.Generator().manual_seed(DATA_SEED + rank)
    out = []
    for length in lengths:
        x, y = model.workload.make_batch(batch_size, gen, torch.device("cpu"))
        full = x.shape[1]
        out.append((_cut(x, full, length), _cut(y, full, length)))
    return out


def padded(batches: list[Batch], buckets: tuple[int, ...]) -> list[Batch]:
    """The batches padded at the end to the next bucket (labels -100: not in the loss)."""
    out = []
    for x, y in batches:
        b = pad_to_bucket({"input_ids": x, "labels": y}, buckets)
        out.append((b["input_ids"], b["labels"]))
    return out


def _cut(t: torch.Tensor, full: int, length: int) -> torch.Tensor:
    return t[:, :length].contiguous() if t.dim() > 1 and t.shape[1] == full else t
