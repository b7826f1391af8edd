"""Ways to run a DDP training step, behind one switch: `make_step(..., strategy=...)`.

    step = ddpgraph.make_step(train_step, model=ddp, optimizer=opt, strategy="auto")
    loss = step(x, y)          # the first call measures and chooses; see step.reason

"whole" (`capture_step`), "compile" (fusion inside the whole-step graph), "partial"
(graphs of submodules, DDP eager), "reduce-overhead" (torch.compile's own graphs),
"eager", and "auto", which measures the ones that apply and keeps the fastest that
trains like eager. docs/strategies.md says when to use which; `names` holds the names,
which `ddpgraph bench` uses for its rows too.
"""

from .auto import AutoStep
from .base import TrainStep
from .compiled import CompiledStep
from .dynamo import CompileSpec
from .eager import EagerStep
from .make import DEFAULT_CANDIDATES, STRATEGIES, StrategyInfo, make_step
from .names import STRATEGY_NAMES, StrategyName
from .partial_step import PartialStep
from .reduce_overhead import ReduceOverheadStep
from .selection import SelectionCode, SelectionReport, TrialResult, TrialStatus
from .trials import Candidate, TrialSettings

__all__ = [
    "DEFAULT_CANDIDATES",
    "STRATEGIES",
    "STRATEGY_NAMES",
    "AutoStep",
    "Candidate",
    "CompileSpec",
    "CompiledStep",
    "EagerStep",
    "PartialStep",
    "ReduceOverheadStep",
    "SelectionCode",
    "SelectionReport",
    "StrategyInfo",
    "StrategyName",
    "TrainStep",
    "TrialResult",
    "TrialSettings",
    "TrialStatus",
    "make_step",
]
