"""The names of the ways to run a training step, as `make_step` and `ddpgraph bench` spell them.

One vocabulary, read by both, so that a row of a benchmark table is the strategy a user
passes to `make_step` under the same name:

    eager            the step as written, DDP eager
    whole            `capture_step`: the whole step as one CUDA graph
    compile          `capture_step(compile=True)`: the model compiled by inductor for
                     fusion (no graphs of its own), the whole step captured around it
    partial          graphs of the collective-free submodules, DDP's all-reduces eager
    reduce-overhead  `torch.compile(mode="reduce-overhead")`: torch.compile's own graphs
    auto             `make_step` only: measures the others and keeps the fastest

and two rows only the benchmark runs, as references `make_step` does not offer:

    torch-compile    plain `torch.compile(ddp)` in its default mode, no graphs
    recipe           PyTorch's documented whole-step capture, written out by hand
"""

from __future__ import annotations

from typing import Literal, get_args

StrategyName = Literal["whole", "partial", "compile", "reduce-overhead", "eager", "auto"]
STRATEGY_NAMES: tuple[str, ...] = get_args(StrategyName)

BenchOnlyName = Literal["torch-compile", "recipe"]
BENCH_ONLY_NAMES: tuple[str, ...] = get_args(BenchOnlyName)

# What each name runs, in the words of the API a user would call for it.
RUNS: dict[str, str] = {
    "eager": "DDP as written",
    "whole": "capture_step",
    "compile": "capture_step(compile=True)",
    "partial": "make_step(strategy='partial')",
    "reduce-overhead": "torch.compile(mode='reduce-overhead')",
    "auto": "make_step(strategy='auto')",
    "torch-compile": "torch.compile, default mode",
    "recipe": "PyTorch's hand-written capture",
}


def hint_for_unknown(name: object) -> str:
    """The fix to suggest when `make_step` is given `name`, which is not one of its own."""
    if isinstance(name, str) and name in BENCH_ONLY_NAMES:
        return (
            f"{name!r} ({RUNS[name]}) is a reference row of `ddpgraph bench`, "
            "not a make_step strategy"
        )
    return "use strategy='auto' to let ddpgraph measure and choose"
