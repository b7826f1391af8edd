"""Deprecated path: `ddpgraph.cli` moved to `ddpgraph.app.cli`; removed in the next release."""

from ._moved import moved
from .app.cli import COMMANDS, build_parser, main

moved("ddpgraph.cli", "ddpgraph.app.cli")

__all__ = ["COMMANDS", "build_parser", "main"]

if __name__ == "__main__":  # `python -m ddpgraph.cli`, as before the move
    import sys

    sys.exit(main())
