"""`ddpgraph doctor`: run a DDP training script and name the cause of a failed capture.

    ddpgraph doctor train.py --lr 3e-4           # one process per GPU (2 on CPU)
    ddpgraph doctor --nproc 2 --json train.py    # the report as JSON on stdout
    ddpgraph doctor --env                        # versions, GPUs, capture features

The script runs unmodified under torchrun, with PyTorch instrumented before it starts
(CUDA graph capture and replay, DDP, optimizers, load_state_dict). When it finishes or
fails, the doctor prints each problem once with the ranks it happened on, the line of
the script it concerns, and the fix. Exit status: 0 when nothing was found, 1 when
findings were reported, 2 for a usage error, 3 when nothing could be checked because
there is no GPU (the only finding is NO_CUDA; docs/doctor.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..app.console import console
from ..app.launch import default_nproc
from ..errors import usage_error
from .report import build_report, exit_status, render, render_env
from .run import run_script, script_exists

DEFAULT_TIMEOUT_S = 600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes to run (default: one per GPU, or 2 on CPU)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the report as JSON (the script's output goes to stderr)",
    )
    parser.add_argument(
        "--env", action="store_true", help="report the environment instead of running a script"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=(
            "stop the script after this many seconds and report where each rank was "
            f"(default: {DEFAULT_TIMEOUT_S:g})"
        ),
    )
    parser.add_argument(
        "script", nargs="?", help="the training script, as you would pass it to torchrun"
    )
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="arguments for the script, passed unchanged"
    )


def main(args: argparse.Namespace, argv: list[str]) -> int:
    problem = _usage_problem(args)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    if args.env:
        # Imported here, not at the top: collecting the environment imports torch, which
        # the launching process of `ddpgraph doctor script.py` never needs.
        from . import env

        report = env.collect()
        if args.json:
            print(json.dumps(report.to_json(), indent=1))
        else:
            render_env(report, console())
        return exit_status(report.findings)
    nproc = args.nproc or default_nproc()
    result = run_script(
        args.script,
        list(args.script_args),
        nproc=nproc,
        timeout_s=args.timeout,
        quiet_stdout=args.json,
    )
    doctor = build_report(args.script, list(args.script_args), nproc, args.timeout, result)
    if args.json:
        print(json.dumps(doctor.to_json(), indent=1))
    else:
        render(doctor, console())
    return doctor.exit_code


def _usage_problem(args: argparse.Namespace) -> str | None:
    if args.env:
        if args.script is not None:
            return str(
                usage_error(
                    "`ddpgraph doctor --env`",
                    f"expected no script, got {args.script!r}",
                    "run `ddpgraph doctor --env` alone, or `ddpgraph doctor script.py`",
                )
            )
        return None
    if args.script is None:
        return str(
            usage_error(
                "`ddpgraph doctor`",
                "expected a script to run",
                "run `ddpgraph doctor train.py [arguments]`, or `ddpgraph doctor --env`",
            )
        )
    if not script_exists(args.script):
        what = "a directory" if os.path.isdir(args.script) else "no such file"
        return str(
            usage_error(
                "`ddpgraph doctor script`",
                f"expected a Python script file, got {what}: {args.script!r}",
                "pass the path of a Python training script",
            )
        )
    if args.nproc is not None and args.nproc < 1:
        return str(
            usage_error(
                "`--nproc`",
                f"expected a number >= 1, got {args.nproc}",
                "leave it out for one process per GPU",
            )
        )
    if args.timeout <= 0:
        return str(
            usage_error(
                "`--timeout`",
                f"expected seconds > 0, got {args.timeout:g}",
                "leave it out for the default",
            )
        )
    return None
