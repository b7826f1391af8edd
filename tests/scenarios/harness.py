"""Runs named scenarios inside torchrun workers and writes each rank's results as JSON.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/scenarios/cpu_core.py --out DIR name1 name2 ...

A scenario is a function taking `DistInfo` and returning a JSON-able dict. An exception
is recorded as {"error": traceback} and the next scenario still runs, after a barrier.

A name `recording:NAME` runs scenario NAME with the CPU recording backend wherever the
scenario asks for `harness.backend()`; a plain NAME runs it with the stand-in backend.
Both kinds run in one launch, so a second backend costs no second torchrun start.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import functools
import json
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import collector
import ddpgraph
from ddpgraph.backends.graph import GraphBackend
from ddpgraph.backends.recording import RecordingBackend
from ddpgraph.ddp.distributed import DistInfo, init_distributed

Scenario = Callable[[DistInfo], dict[str, Any]]
RECORDING = "recording"
_variant = {"backend": "pass-through"}
_out: list[str] = []  # the launch's --out folder
# The process group's timeout: the launch's own (DDPGRAPH_TEST_PG_TIMEOUT), or a shorter
# one for the scenarios of `with_group_timeout`.
_GROUP_TIMEOUT_S = {"launch": 120.0}
# Optimizers whose CPU kernels read nothing on the host (the fused ones), which the
# recording backend needs as a CUDA graph needs capturable ones.
_FUSED_ON_CPU = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def backend(**kwargs: Any) -> GraphBackend:
    """The graph backend of the running variant: `PassThroughBackend(**kwargs)` or
    `RecordingBackend(**kwargs)` (both take `fail_ranks` and `message`)."""
    if _variant["backend"] == RECORDING:
        return RecordingBackend(**kwargs)
    return ddpgraph.PassThroughBackend(**kwargs)


def recording() -> bool:
    return _variant["backend"] == RECORDING


def optimizer_kwargs(opt_cls: type[torch.optim.Optimizer]) -> dict[str, Any]:
    """Extra constructor arguments for `opt_cls` in the running variant: the fused CPU
    kernel under the recording backend (the eager reference gets the same)."""
    return {"fused": True} if recording() and issubclass(opt_cls, _FUSED_ON_CPU) else {}


def with_group_timeout(registry: dict[str, Scenario], seconds: float) -> dict[str, Scenario]:
    """`registry` with each scenario run under a process-group timeout of `seconds`, the
    launch's own restored after it: there a rank left alone in a collective fails its
    scenario rather than passing late, and the scenarios of other scripts share the launch
    (together.py) with the usual timeout."""
    return {name: _under_timeout(scenario, seconds) for name, scenario in registry.items()}


def _under_timeout(scenario: Scenario, seconds: float) -> Scenario:
    @functools.wraps(scenario)
    def run(info: DistInfo) -> dict[str, Any]:
        # Private in PyTorch, present since 2.2; looked up by presence, and a clear error
        # (the scenario fails) where it is gone.
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if set_timeout is None:
            raise RuntimeError("this PyTorch has no distributed_c10d._set_pg_timeout")
        set_timeout(datetime.timedelta(seconds=seconds))
        try:
            return scenario(info)
        finally:
            set_timeout(datetime.timedelta(seconds=_GROUP_TIMEOUT_S["launch"]))

    return run


def out_dir() -> str:
    """The folder the launch writes its results to (`--out`), for a scenario's own files."""
    return _out[0]


def split_name(name: str) -> tuple[str, str]:
    """("recording", "x") for "recording:x"; ("pass-through", "x") for "x"."""
    kind, _, base = name.rpartition(":")
    return (kind or "pass-through"), base


def run(registry: dict[str, Scenario] | Callable[[list[str]], dict[str, Scenario]]) -> None:
    """Run the named scenarios of `registry`: a dict, or a function of the names that
    makes it (together.py, which imports the scripts the names come from)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("names", nargs="*")
    args = parser.parse_args()
    if callable(registry):
        registry = registry(args.names)
    # torchrun ends the ranks still running with SIGTERM once one fails: a rank that hung
    # first writes every thread's stack to the launch's log, to say where.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    _GROUP_TIMEOUT_S["launch"] = float(os.environ.get("DDPGRAPH_TEST_PG_TIMEOUT", "120"))
    info = init_distributed(timeout_s=_GROUP_TIMEOUT_S["launch"])
    # What the imports made is never garbage: left out of every collection, the one
    # after each scenario below included (tests/collector.py).
    collector.settle()
    collector.tune()
    os.makedirs(args.out, exist_ok=True)
    _out[:] = [os.path.abspath(args.out)]
    for name in args.names or list(registry):
        _variant["backend"], base = split_name(name)
        started, cpu = time.monotonic(), time.process_time()
        try:
            result = registry[base](info)
        except Exception:
            result = {"error": traceback.format_exc()}
        # What a scenario costs, for whoever trims the suite (no test reads it).
        result["cost_s"] = {"wall": time.monotonic() - started, "cpu": time.process_time() - cpu}
        result["rank"] = info.rank
        result["world_size"] = info.world_size
        with open(os.path.join(args.out, f"{name}.rank{info.rank}.json"), "w") as fh:
            json.dump(result, fh, indent=1, default=str)
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        # The scenario's models and steps are garbage now, some in reference cycles (DDP's
        # hooks): collected here, not in a later scenario's forked DataLoader worker, where
        # freeing a CUDA tensor that NCCL's stream used aborts the worker (CUDA
        # "initialization error" in the caching allocator). What is left lives on (the
        # libraries a scenario imported): later collections leave it out.
        collector.settle()
        dist.barrier()
    dist.destroy_process_group()


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max over tensors of max|a-b| / max|a| (0 when equal)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        x, y = x.detach().double().cpu(), y.detach().double().cpu()
        scale = float(x.abs().max()) or 1.0
        worst = max(worst, float((x - y).abs().max()) / scale)
    return worst


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def loss_rel_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True)), default=0.0)


def on_device(step: Any, device: Any) -> Any:
    """`step` called as an eager loop calls it: a CPU batch (a DataLoader's) copied to the
    GPU first."""

    def call(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _to_device((args, kwargs), device)
        return step(*args, **kwargs)

    return call


def with_same_settings(opt: Any, step: Any, device: Any) -> Any:
    """`step` run as `capture_step` runs its eager steps: the optimizer's graph-safe mode
    installed around each call (`GraphSafeOptimizers.installed`), the reference that a
    captured run is compared with bit for bit."""
    from ddpgraph.optimizer.safe_optimizers import GraphSafeOptimizers

    safe = GraphSafeOptimizers([opt], device)
    assert safe.prepare() is None

    def call(*args: Any, **kwargs: Any) -> Any:
        with safe.installed():
            return step(*args, **kwargs)

    # A CPU batch goes to the GPU first, as `capture_step` stages it.
    return on_device(call, device)


def _to_device(tree: Any, device: Any) -> Any:
    from torch.utils._pytree import tree_map

    def move(x: Any) -> Any:
        if (
            isinstance(x, torch.Tensor)
            and torch.device(device).type == "cuda"
            and x.device.type == "cpu"
        ):
            return x.to(device, non_blocking=True)
        return x

    return tree_map(move, tree)
