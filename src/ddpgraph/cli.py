"""The `ddpgraph` command: `demo`, `bench`, `doctor`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpgraph",
        description="Capture whole DDP training steps as CUDA graphs, and diagnose why they fail.",
    )
    parser.add_argument("--version", action="version", version=f"ddpgraph {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from . import demo

    demo_parser = sub.add_parser(
        "demo",
        help="train a small GPT eagerly and captured, and show the speedup",
        description=demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(demo_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "demo":
        from . import demo

        return demo.main(args, args_list[1:])
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
