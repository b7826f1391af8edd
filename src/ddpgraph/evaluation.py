"""Deprecated path: `ddpgraph.evaluation` moved to `ddpgraph.strategies.evaluation`; removed in the next release."""

from ._moved import moved
from .strategies.evaluation import (
    MAX_EXTRA_WARMUP,
    CapturedEval,
    EvalOutcome,
    capture_eval,
    evaluating,
)

moved("ddpgraph.evaluation", "ddpgraph.strategies.evaluation")

__all__ = ["MAX_EXTRA_WARMUP", "CapturedEval", "EvalOutcome", "capture_eval", "evaluating"]
