"""`ddpgraph demo`: train a small GPT eagerly and captured, side by side, and compare.

    ddpgraph demo                              # one process per GPU, or 2 CPU processes
    ddpgraph demo --nproc 2 --steps 100 --json demo.json
    torchrun --nproc_per_node=2 -m ddpgraph demo

Three runs from the same initial weights and the same batches:
  1. eager DDP with a default AdamW: what a training script does today;
  2. eager DDP with the graph-safe AdamW that capture_step uses (capturable kernels,
     learning rate in a device tensor): the reference the captured run must match;
  3. capture_step: warm-up, one capture, replays.
Each trains with a cosine LR schedule, gradient clipping and (on GPU) bf16 autocast.
Without a GPU, capture_step uses the CPU recording backend, which replays the recorded
operations and all-reduces without Python: it shows what a capture would do, and its
times are CPU times, never a GPU speed-up.
"""

from __future__ import annotations

import argparse

from ..ddp.process import launched_by_torchrun
from ..errors import DdpGraphUsageError
from . import arguments
from .launch import run_under_torchrun


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps per run (default: 300 on GPU, 40 on CPU)",
    )
    parser.add_argument(
        "--batch", type=int, default=8, help="sequences per GPU per step (default: 8)"
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes when launching itself (default: GPUs, or 2 on CPU)",
    )
    parser.add_argument(
        "--json", dest="json_path", default=None, help="also write the results as JSON to this file"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="run on CPU processes even if CUDA is available"
    )


def check_args(args: argparse.Namespace) -> None:
    """Every argument, before any worker starts (`DdpGraphUsageError` for the first bad one)."""
    arguments.at_least(
        "--steps", args.steps, 2, "use --steps 2 or more: timing needs a window of steps"
    )
    arguments.at_least("--batch", args.batch, 1)
    arguments.process_count(args.nproc, args.cpu)
    arguments.output_file("--json", args.json_path, "demo.json")


def main(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        check_args(args)
    except DdpGraphUsageError as err:
        return arguments.report(err)
    if not launched_by_torchrun():
        crowded = arguments.crowded_cores(args.nproc, args.cpu)
        arguments.say_before_start([crowded] if crowded else [])
        return run_under_torchrun(["demo", *argv], args.nproc or (2 if args.cpu else None))
    # Imported here, not at the top: the worker part imports torch, which the launching
    # process (parse, check, start torchrun) never needs; only torchrun's workers load it.
    from . import demo_worker

    return demo_worker.main(args)
