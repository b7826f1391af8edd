"""`pad_to_bucket`: padding to bucket lengths changes no loss of a causal LM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ddpgraph
from ddpgraph.app.models import GPTConfig, TinyGPT
from ddpgraph.family.buckets import bucket_collate, choose_buckets, next_bucket, pad_to_bucket


def _lm_loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def test_padding_at_the_end_leaves_a_causal_lm_loss_unchanged() -> None:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=50, block=64, layers=2, dim=32, heads=4)).double()
    ids = torch.randint(1, 50, (3, 21))
    padded = pad_to_bucket(
        {"input_ids": ids, "labels": ids.clone()}, buckets=(16, 32, 64), pad_id=0
    )
    assert padded["input_ids"].shape == (3, 32)
    assert torch.equal(padded["input_ids"][:, :21], ids) and bool(
        (padded["input_ids"][:, 21:] == 0).all()
    )
    assert bool((padded["labels"][:, 21:] == -100).all())
    assert padded["attention_mask"].sum().item() == 3 * 21  # added: 1 on real tokens only
    plain = _lm_loss(model, ids, ids)
    bucketed = _lm_loss(model, padded["input_ids"], padded["labels"])
    # Equal up to float64 rounding (the longer matmuls may sum in another order); a
    # padding that leaked into the loss would move it by far more.
    assert torch.allclose(plain, bucketed, rtol=1e-12, atol=0)
    leaked = _lm_loss(model, padded["input_ids"], padded["input_ids"])
    assert not torch.allclose(plain, leaked, rtol=1e-6)


def test_existing_mask_and_labels_are_padded_with_their_values() -> None:
    ids = torch.ones(2, 5, dtype=torch.long)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones(2, 5, dtype=torch.long),
        "labels": ids,
        "n": 7,
    }
    out = pad_to_bucket(batch, buckets=(8,), pad_id=3, label_pad=-1)
    assert out["input_ids"][0].tolist() == [1] * 5 + [3] * 3
    assert out["attention_mask"][0].tolist() == [1] * 5 + [0] * 3
    assert out["labels"][0].tolist() == [1] * 5 + [-1] * 3
    assert out["n"] == 7
    assert pad_to_bucket({"input_ids": torch.ones(1, 8, dtype=torch.long)}, buckets=(8,))[
        "input_ids"
    ].shape == (1, 8)


def test_bucket_choice_and_errors() -> None:
    assert next_bucket(129, (512, 128, 256)) == 256
    assert choose_buckets(range(1, 513), count=4) == (128, 256, 384, 512)
    assert choose_buckets([70, 70, 70], count=3) == (128,)
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="longer than the largest bucket"):
        pad_to_bucket({"input_ids": torch.ones(1, 9, dtype=torch.long)}, buckets=(8,))
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="no padding value"):
        pad_to_bucket(
            {"input_ids": torch.ones(1, 5, dtype=torch.long), "extra": torch.ones(1, 5)},
            buckets=(8,),
        )
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="positive int lengths"):
        pad_to_bucket({"input_ids": torch.ones(1, 5, dtype=torch.long)}, buckets=())


def test_collate_wrapper_pads_each_batch() -> None:
    collate = bucket_collate(lambda xs: {"input_ids": torch.stack(xs)}, buckets=(4, 8))
    assert collate([torch.ones(3, dtype=torch.long)] * 2)["input_ids"].shape == (2, 4)
