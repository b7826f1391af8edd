"""Choosing bucket lengths from the sequence lengths seen (`choose_buckets`, which
`ddpgraph.family.buckets` exports): arithmetic on lengths, without PyTorch, so that
`ddpgraph bench --seq-lens` is checked before any worker imports it.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import usage_error


def choose_buckets(lengths: Iterable[int], count: int = 4, multiple: int = 64) -> tuple[int, ...]:
    """`count` bucket lengths from the sequence lengths seen: their quantiles rounded up to
    a multiple of `multiple`; the last one holds the longest length."""
    seen = sorted(int(n) for n in lengths)
    if not seen or count < 1 or multiple < 1:
        raise usage_error(
            "`choose_buckets`",
            f"expected some lengths, count >= 1 and multiple >= 1, got {len(seen)} lengths, "
            f"count={count}, multiple={multiple}",
            "pass the lengths of a sample of batches",
        )
    picks = [seen[min(len(seen) - 1, -(-len(seen) * (i + 1) // count) - 1)] for i in range(count)]
    return tuple(sorted({-(-n // multiple) * multiple for n in picks}))
