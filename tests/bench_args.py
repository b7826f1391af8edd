"""The `bench` command's arguments as the unit tests give them, and the plan its workers
build from them: the front checks the arguments (`choose`), each worker then builds the
plan (`plan_of`); a test of the plan takes both steps, as a run does."""

from __future__ import annotations

import argparse

from ddpgraph.app.cli import build_parser
from ddpgraph.bench.choice import choose
from ddpgraph.bench.suite import Plan
from ddpgraph.bench.worker import plan_of


def parse(*argv: str) -> argparse.Namespace:
    """`ddpgraph bench ARGV...` as the command line parses it."""
    return build_parser("bench").parse_args(["bench", *argv])


def plan(args: argparse.Namespace) -> Plan:
    """What the workers build from `args`, once the front has checked them."""
    return plan_of(choose(args))
