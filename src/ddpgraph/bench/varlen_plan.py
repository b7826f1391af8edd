"""The variable-sequence-length case of `ddpgraph bench`: its arguments, checked without
PyTorch before any worker starts (its batches are built by `varlen_data`).

    ddpgraph bench --model gpt,hf-gpt2 --seq-lens 64:512 [--buckets 64,128,256,512]

Dynamic padding gives each step its own sequence length. Here each step's length is drawn
uniformly from LOW..HIGH (inclusive) by a generator seeded with `LENGTHS_SEED` + rank, one
length per warm-up step; the timed and profiled steps then go over the same lengths again,
in the same order, as a second epoch over the same data would. So every row is timed in
its steady state (each length's first-use costs, and `reduce-overhead`'s recording of a
new size, fall in its warm-up), and every row sees the same lengths in the same order.

A step's batch at length T is the workload's batch at HIGH tokens cut to its first T
tokens. The bucketed rows train on the same batches padded at the end to the next bucket
by `ddpgraph.pad_to_bucket`: inputs with 0, labels with -100, which cross-entropy's
`ignore_index` leaves out of the loss, so padding changes no loss (a user's loss must
ignore -100 labels too, as `F.cross_entropy` does by default).

Default buckets: what `ddpgraph.family.buckets.choose_buckets` picks for the lengths the
steps draw from, four quartiles of LOW..HIGH rounded up to a multiple of 8 (at most HIGH):
64:512 gives 176,288,400,512, a quarter of the range wide each, so a padded batch is on
average an eighth of the range longer than its own (56 tokens at 64:512). HIGH and its
halves (64,128,256,512) pad a batch by a third of its length on average there, which a
step that keeps the GPU busy pays in full: `whole+buckets` on `hf-gpt2` reached 73% of the
fixed-shape speedup with them (docs/gpu-runs.md, run 33).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import usage_error
from ..family.bucket_lengths import choose_buckets
from .names import ModelInfo

LENGTHS_SEED = 4321
# Warm-up steps (one length each) at least: DDP's 11 iterations and the first capture,
# then room for each bucket's first eager call and its capture.
MIN_WARMUP = 40
MAX_BUCKETS = 4
BUCKET_MULTIPLE = 8  # tensor-core friendly lengths
# With peers, a graph is added only on a decision point: every `agree_every`-th call.
AGREE_EVERY = 4
# Row families, the strategy names the rows belong to (`--strategies` picks among them).
FAMILIES = ("eager", "reduce-overhead", "whole", "compile")
PADDING_NOTE = (
    "Bucketed rows pad each batch at the end to the next bucket; padded labels are -100 "
    "(cross-entropy's ignore_index), so padding is left out of the loss."
)


@dataclass(frozen=True)
class VarLen:
    low: int
    high: int
    buckets: tuple[int, ...]
    families: tuple[str, ...] = FAMILIES

    @property
    def fixed_len(self) -> int:
        """The fixed-shape reference rows' length: the mean of the drawn lengths."""
        return (self.low + self.high) // 2

    def describe(self) -> dict[str, Any]:
        return {
            "seq_lens": [self.low, self.high],
            "buckets": list(self.buckets),
            "fixed_len": self.fixed_len,
            "lengths_seed": LENGTHS_SEED,
            "agree_every": AGREE_EVERY,
            "families": list(self.families),
            "padding": PADDING_NOTE,
        }


def parse_varlen(
    seq_lens: str | None, buckets: str | None, strategies: list[str] | None
) -> VarLen | None:
    """`--seq-lens LOW:HIGH`, `--buckets` and `--strategies` checked; None without --seq-lens."""
    if seq_lens is None:
        if buckets is not None:
            raise usage_error(
                "`--buckets`",
                "expected it with `--seq-lens`, got it alone",
                "add `--seq-lens LOW:HIGH`, e.g. `--seq-lens 64:512`",
            )
        return None
    low, high = _range(seq_lens)
    chosen = default_buckets(low, high) if buckets is None else _buckets(buckets, low, high)
    families = FAMILIES if strategies is None else _families(strategies)
    return VarLen(low, high, chosen, families)


def default_buckets(low: int, high: int) -> tuple[int, ...]:
    """`MAX_BUCKETS` quartiles of the uniform draw LOW..HIGH, rounded up to a multiple of
    `BUCKET_MULTIPLE` but never past HIGH (the model is built for HIGH positions). The
    same on every rank: they come from the range, not from a rank's own draw."""
    picks = choose_buckets(range(low, high + 1), count=MAX_BUCKETS, multiple=BUCKET_MULTIPLE)
    return tuple(sorted({min(b, high) for b in picks}))


def _range(text: str) -> tuple[int, int]:
    low_text, sep, high_text = text.partition(":")
    try:
        low, high = int(low_text), int(high_text)
    except ValueError:
        low = high = 0
    if not sep or low < 1 or high <= low:
        raise usage_error(
            "`--seq-lens`",
            f"expected LOW:HIGH with 1 <= LOW < HIGH, got {text!r}",
            "give the range the lengths are drawn from, e.g. `--seq-lens 64:512`; "
            "for one length, leave it out",
        )
    return low, high


def _buckets(text: str, low: int, high: int) -> tuple[int, ...]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise usage_error(
            "`--buckets`",
            f"expected positive lengths like `64,128,256,512`, got {text!r}",
            "give bucket lengths separated by commas",
        )
    if values[-1] < high:
        raise usage_error(
            "`--buckets`",
            f"expected the largest bucket to hold the longest length {high}, got {text!r}",
            f"add a bucket of at least {high}, or lower the HIGH of --seq-lens",
        )
    unused = [b for b in values if b < low]
    if unused:
        raise usage_error(
            "`--buckets`",
            f"bucket(s) {', '.join(map(str, unused))} are shorter than every "
            f"length of --seq-lens {low}:{high}",
            f"give buckets of at least {low}; they would never be used",
        )
    return tuple(values)


def _families(names: list[str]) -> tuple[str, ...]:
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or not names:
        raise usage_error(
            "`--strategies` with `--seq-lens`",
            f"expected names from {', '.join(FAMILIES)}, "
            f"got {', '.join(map(repr, unknown)) or 'none'}",
            "the variable-length case has rows of these strategies; "
            "leave --strategies out for all of them",
        )
    return tuple(f for f in FAMILIES if f in names)


def check_sized(model: ModelInfo, high: int) -> None:
    """Refuse a model that cannot train sequences of `high` tokens: not a sequence model,
    a preset whose positions end before `high`, or a factory's shorter batches. The
    built-in GPT and the presets with `longest` are built again for `high` tokens
    (`varlen_data.sized`)."""
    if model.unit != "tokens":
        raise usage_error(
            f"`--seq-lens` with `--model {model.spec}`",
            f"expected a sequence workload (batches of tokens), got one of {model.unit}",
            "use --seq-lens with gpt, hf-gpt2, hf-llama or a MODULE:FACTORY whose "
            f"Workload has unit='tokens', or leave {model.spec} out",
        )
    if model.spec == "gpt":
        return
    if model.longest is not None:
        if high > model.longest:
            raise usage_error(
                f"`--seq-lens` with `--model {model.spec}`",
                f"expected lengths up to the model's {model.longest} positions, got {high}",
                f"use a HIGH of at most {model.longest}",
            )
        return
    if model.per_sample < high:
        raise usage_error(
            f"`--seq-lens` with `--model {model.spec}`",
            f"the factory's batches have {model.per_sample} tokens per sequence, "
            f"fewer than the longest length {high}",
            f"make the Workload's batches (and `per_sample`) at least {high} tokens long, "
            "or lower HIGH",
        )
