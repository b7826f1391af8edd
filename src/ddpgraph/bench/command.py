"""`ddpgraph bench`: what a whole-step CUDA graph buys on a model, beside every alternative.

    ddpgraph bench                                  # gpt and resnet18, every strategy
    ddpgraph bench --model gpt,resnet18 --batch-sizes gpt=8,32 resnet18=32,128 \\
        --json bench.json --plot bench.png
    ddpgraph bench --model my_models:make_workload --strategies eager,whole --nproc 2
    ddpgraph bench --model gpt,hf-gpt2 --seq-lens 64:512      # variable sequence lengths
    torchrun --nproc_per_node=2 -m ddpgraph bench --model gpt

As a plain command it starts one worker per GPU (two CPU workers without CUDA; `--nproc`
to choose) through torchrun. Without CUDA and without `--model` it benchmarks CPU-sized
models, and says so. For each model and batch size it runs each strategy in a fresh setup from the
same initial weights on the same batches, under `make_step`'s strategy names: eager DDP,
torch.compile (`torch-compile`, default mode, and `reduce-overhead`), PyTorch's
hand-written whole-step graph `recipe`, `whole` (capture_step), `compile` (capture_step
around a compiled model) and `partial` (`--list-strategies` shows them). It reports
ms/step (median of timing windows, with their spread), speedup over eager, GPU busy
(summed kernel time over step time, profiled on rank 0), capture time and peak memory,
with batches already on the GPU and, unless --no-data-loader, fed by a DataLoader with
pinned memory. On CPU only the eager strategies run.

With `--seq-lens LOW:HIGH` it runs the variable-sequence-length case instead
(`varlen_plan`, `varlen_rows`): eager, reduce-overhead and capture_step on lengths drawn
from that range, and capture_step with length buckets and a family of graphs.

A model of your own: `--model MODULE:FACTORY`, where FACTORY() returns a
`ddpgraph.app.models.Workload` or a tuple (model, loss, make_batch); see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse

from ..app import arguments
from ..app.console import console
from ..app.launch import run_under_torchrun
from ..ddp.process import cuda_available, launched_by_torchrun
from ..errors import DdpGraphUsageError
from .choice import DEFAULT_MODELS, Choice, choose
from .names import PRESET_PACKAGES
from .settings import MIN_WARMUP, Settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`ddpgraph bench`'s arguments, in the order its help lists them."""
    _what_runs(parser)
    _how_long(parser, Settings())
    _where_and_output(parser)


def _what_runs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help=(
            "comma-separated built-in names (gpt, mlp, resnet18), presets "
            f"({', '.join(PRESET_PACKAGES)}) or MODULE:FACTORY (default: {DEFAULT_MODELS}; "
            "without CUDA, CPU-sized gpt and mlp)"
        ),
    )
    parser.add_argument(
        "--batch-sizes",
        nargs="+",
        metavar="SIZES",
        help=(
            "per-GPU batch sizes: `8,32` for every model, or `gpt=8,32 resnet18=32,128` "
            "(default: gpt 8,32; resnet18 32,128; mlp 64,256; others 8,32)"
        ),
    )
    parser.add_argument(
        "--strategies",
        default=None,
        help=(
            "comma-separated strategies to run, by make_step's names "
            "(default: every available one; see --list-strategies)"
        ),
    )


def _how_long(parser: argparse.ArgumentParser, defaults: Settings) -> None:
    parser.add_argument(
        "--steps",
        type=int,
        default=defaults.steps,
        help=f"timed steps per strategy and feed (default: {defaults.steps})",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=defaults.warmup,
        help=f"untimed steps before timing, at least {MIN_WARMUP} (default: {defaults.warmup})",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=defaults.profile_steps,
        help=(
            "steps profiled on rank 0 for GPU busy; 0 turns profiling off "
            f"(default: {defaults.profile_steps})"
        ),
    )
    parser.add_argument(
        "--data-loader",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time steps fed by a DataLoader with pinned memory (default: on)",
    )
    parser.add_argument(
        "--loader-workers",
        type=int,
        default=defaults.loader_workers,
        help=f"DataLoader worker processes (default: {defaults.loader_workers})",
    )
    parser.add_argument(
        "--amp",
        choices=("bf16", "off"),
        default="bf16",
        help="bf16 autocast on GPU, or fp32 (default: bf16)",
    )


def _where_and_output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes when launching itself (default: GPUs, or 2 on CPU)",
    )
    parser.add_argument(
        "--json",
        dest="json_path",
        default=None,
        help="write the results as JSON to this file (rewritten after every strategy)",
    )
    parser.add_argument(
        "--plot",
        dest="plot_path",
        default=None,
        help="write a plot of speedup against batch size to this file (.png, .svg, .pdf)",
    )
    parser.add_argument(
        "--seq-lens",
        default=None,
        metavar="LOW:HIGH",
        help=(
            "the variable-sequence-length case: each step's length drawn uniformly from LOW..HIGH "
            "(seeded), for sequence models (gpt, hf-gpt2, hf-llama, token factories)"
        ),
    )
    parser.add_argument(
        "--buckets",
        default=None,
        help=(
            "bucket lengths for --seq-lens, e.g. 176,288,400,512 (default: the quartiles "
            "of LOW..HIGH, rounded up to a multiple of 8)"
        ),
    )
    parser.add_argument(
        "--cpu", action="store_true", help="run on CPU processes even if CUDA is available"
    )
    parser.add_argument(
        "--list-strategies", action="store_true", help="list the strategies and exit"
    )


def main(args: argparse.Namespace, argv: list[str]) -> int:
    # The worker part is imported inside the function, not at the top: it imports torch,
    # which the launching process (parse, check, start torchrun) never needs.
    if args.list_strategies:
        from .worker import strategy_table

        console().print(strategy_table())
        return 0
    try:
        chosen = choose(args)
    except DdpGraphUsageError as err:
        return arguments.report(err)
    if not launched_by_torchrun():
        arguments.say_before_start(slow_runs(chosen, args))
        return run_under_torchrun(["bench", *argv], args.nproc or (2 if args.cpu else None))
    from . import worker

    return worker.main(chosen, args, argv)


def slow_runs(chosen: Choice, args: argparse.Namespace) -> list[str]:
    """What in the plan takes minutes where it will run, said before it starts: more CPU
    processes than cores, and GPU-sized preset models on CPU."""
    said = [arguments.crowded_cores(args.nproc, args.cpu)]
    if not (cuda_available() and not args.cpu):
        big = [m.name for m in chosen.models if m.name in PRESET_PACKAGES]
        if big:
            said.append(
                f"{', '.join(big)} {'is a' if len(big) == 1 else 'are'} GPU-sized "
                f"model{'s' if len(big) > 1 else ''} and there is no GPU here: on CPU processes "
                "every row takes minutes (leave --model out for the CPU-sized defaults, "
                "which check the setup in about a minute)"
            )
    return [s for s in said if s]
