"""A small language model for `ddpgraph bench --seq-lens` on a GPU: the demo GPT at two
layers of width 128, so that the compiled rows' compilations take seconds, not minutes."""

from __future__ import annotations

from ddpgraph.app.models import GPTConfig, Workload, gpt_workload


def small_lm() -> Workload:
    workload = gpt_workload(GPTConfig(vocab=512, block=256, layers=2, dim=128, heads=4))
    workload.name = "small-lm"
    return workload
