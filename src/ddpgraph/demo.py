"""Deprecated path: `ddpgraph.demo` moved to `ddpgraph.app.demo`; removed in the next release."""

from ._moved import moved
from .app.demo import CPU_CONFIG, GPU_CONFIG, RunResult, add_arguments, check_args, main, run

moved("ddpgraph.demo", "ddpgraph.app.demo")

__all__ = ["CPU_CONFIG", "GPU_CONFIG", "RunResult", "add_arguments", "check_args", "main", "run"]
