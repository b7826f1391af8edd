"""The `ddpgraph` command: `demo`, `bench`, `doctor`.

Each subcommand lives in its own module with `add_arguments(parser)` and
`main(args, argv) -> int`; this file only dispatches, importing the module on use so
`ddpgraph --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .. import __version__
from .job import INTERRUPTED_EXIT

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("ddpgraph.app.demo", "train a small GPT eagerly and captured, and show the speedup"),
    "bench": (
        "ddpgraph.bench.command",
        "benchmark a model under every capture strategy, side by side",
    ),
    "doctor": (
        "ddpgraph.doctor.command",
        "run a training script and name the cause of a failed capture",
    ),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `only`, just that command's module is imported (the others get
    a help line), so one command never depends on another's imports."""
    parser = argparse.ArgumentParser(
        prog="ddpgraph",
        description="Capture whole DDP training steps as CUDA graphs, and diagnose why they fail.",
    )
    parser.add_argument("--version", action="version", version=f"ddpgraph {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and err.name.startswith("ddpgraph"):
                continue  # a command not built yet
            raise
        child = sub.add_parser(
            name,
            help=help_text,
            # Full option names only: the commands pass their arguments on to torchrun
            # workers, and torchrun's parser would read an abbreviation as its own option.
            allow_abbrev=False,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(child)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    first = args_list[0] if args_list else None
    parser = build_parser(first if first in COMMANDS else None)
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        result: int = module.main(args, args_list[1:])
    except KeyboardInterrupt:  # the command stopped what it started: one line is enough
        print(f"ddpgraph {args.command}: interrupted.", file=sys.stderr)
        return INTERRUPTED_EXIT
    return result


if __name__ == "__main__":
    sys.exit(main())
