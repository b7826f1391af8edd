"""Pad a language-model batch to one of a few bucket lengths, so that a step with
dynamic padding replays from a handful of graphs (`capture_step(max_graphs=...)`).

    batch = ddpgraph.pad_to_bucket({"input_ids": ids, "labels": ids}, buckets=(128, 256, 512))

Padding goes at the END of every sequence: a causal model's position t reads only
positions <= t, so appended positions change nothing before them, and their labels
are `label_pad` (cross-entropy's `ignore_index`, -100 by default) and their attention
mask 0, so the mean loss over the tokens that count is the unpadded one. Padding at the
start would shift every position of a model with learned positions.

`choose_buckets`, exported here, picks the lengths (`bucket_lengths`, without PyTorch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..errors import usage_error
from .bucket_lengths import choose_buckets

__all__ = ["bucket_collate", "choose_buckets", "next_bucket", "pad_to_bucket"]

# What each well-known key is padded with; `pad_id` replaces the input ids' value.
_DEFAULT_PADS = {"attention_mask": 0, "token_type_ids": 0, "position_ids": 0}


def next_bucket(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `length`."""
    for b in sorted(buckets):
        if b >= length:
            return int(b)
    raise usage_error(
        "`pad_to_bucket`",
        f"a sequence of length {length} is longer than the largest bucket ({max(buckets)})",
        f"add a bucket of at least {length}, or truncate the batch first",
    )


def pad_to_bucket(
    batch: Mapping[str, Any],
    buckets: Sequence[int] = (128, 256, 512),
    *,
    pad_id: int = 0,
    label_pad: int = -100,
    pads: Mapping[str, int] | None = None,
    dim: int = 1,
) -> dict[str, Any]:
    """`batch` (a dict of tensors with the sequence along `dim`) padded at the end to the
    next bucket length.

    `input_ids` gets `pad_id`, `labels` gets `label_pad`, `attention_mask`,
    `token_type_ids` and `position_ids` get 0, other keys what `pads` names. An
    `attention_mask` is added (1 for real tokens) when the batch has none, for models
    that take one. Tensors of another length along `dim`, and other values, pass
    through unchanged.
    """
    _check_buckets(buckets)
    if "input_ids" not in batch or not isinstance(batch["input_ids"], torch.Tensor):
        raise usage_error(
            "`pad_to_bucket(batch)`",
            "expected a dict with an `input_ids` tensor",
            "pass the batch dict your collate function returns",
        )
    ids: torch.Tensor = batch["input_ids"]
    length = ids.shape[dim]
    target = next_bucket(length, buckets)
    values = {**_DEFAULT_PADS, "input_ids": pad_id, "labels": label_pad, **(pads or {})}
    out = dict(batch)
    if "attention_mask" not in out:
        out["attention_mask"] = torch.ones_like(ids, dtype=torch.long)
    for key, value in out.items():
        if not (
            isinstance(value, torch.Tensor) and value.dim() > dim and value.shape[dim] == length
        ):
            continue
        if key not in values:
            raise usage_error(
                f"`pad_to_bucket(batch[{key!r}])`",
                f"`{key}` has the sequence length {length} but no padding value",
                f"pass `pads={{{key!r}: <value>}}`",
            )
        out[key] = _pad_end(value, target, dim, values[key])
    return out


def bucket_collate(
    collate_fn: Callable[[list[Any]], Mapping[str, Any]],
    buckets: Sequence[int] = (128, 256, 512),
    **pad_kwargs: Any,
) -> Callable[[list[Any]], dict[str, Any]]:
    """`collate_fn` followed by `pad_to_bucket`, for `DataLoader(collate_fn=...)`."""
    _check_buckets(buckets)

    def collate(samples: list[Any]) -> dict[str, Any]:
        return pad_to_bucket(collate_fn(samples), buckets, **pad_kwargs)

    return collate


def _pad_end(t: torch.Tensor, target: int, dim: int, value: int) -> torch.Tensor:
    extra = target - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_full(shape, value)], dim=dim)


def _check_buckets(buckets: Sequence[int]) -> None:
    if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets):
        raise usage_error(
            "`pad_to_bucket(buckets=...)`",
            f"expected positive int lengths, got {buckets!r}",
            "pass e.g. `buckets=(128, 256, 512)`, or `choose_buckets(lengths)`",
        )
