"""Deprecated path: `ddpgraph.launch` moved to `ddpgraph.app.launch`; removed in the next release."""

from ._moved import moved
from .app.launch import (
    LAUNCHER_OPTIONS,
    default_nproc,
    run_under_torchrun,
    torchrun_command,
    worker_args,
)

moved("ddpgraph.launch", "ddpgraph.app.launch")

__all__ = ["LAUNCHER_OPTIONS", "default_nproc", "run_under_torchrun", "torchrun_command", "worker_args"]
