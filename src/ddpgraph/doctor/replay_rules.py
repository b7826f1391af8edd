"""The rules applied at each replay of a captured graph: the silent failures.

A replay runs what was recorded, whatever the script changed since. Three changes make a
replay do something other than what the script expects, and each is reported once per
graph, at the first replay that shows it:

* a hyper-parameter held as a Python number changed (a scheduler's `group['lr'] = x`):
  the graph keeps the recorded value (LR_BAKED_INTO_GRAPH);
* `load_state_dict` replaced tensors the graph reads and writes, so the replays keep
  training the old ones (OPTIMIZER_STATE_REPLACED);
* the graph's inputs were freed, or not written since the previous replay: the new batch
  went to tensors the graph does not read (STATIC_INPUT_CHANGED).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from ..findings import Code, Finding, Location
from ..optimizer.graph_safe import NOT_HYPERPARAMETERS
from .observed import Graph, StateLoad

# Kernel choices, not values a replay reads: `capture_step` installs its graph-safe flags
# only while it records (the optimizer stays as the user wrote it), so they differ after.
_KERNEL_FLAGS = frozenset({"capturable", "foreach", "fused", "differentiable"})


def remember_captured_state(graph: Graph, loads_so_far: int) -> None:
    """Keep what the replays are compared with: hyper-parameters, the identity of the
    optimizer state and module tensors, and the inputs' versions."""
    for ref in graph.optimizers:
        opt = ref()
        if opt is None:
            continue
        graph.hyper.append(
            [
                {k: v for k, v in g.items() if k not in NOT_HYPERPARAMETERS | _KERNEL_FLAGS}
                for g in opt.param_groups
            ]
        )
        graph.state.append(
            [
                (p, key, value)
                for p, s in opt.state.items()
                for key, value in s.items()
                if isinstance(value, torch.Tensor)
            ]
        )
    for module_ref in graph.module_refs:
        module = module_ref()
        if module is not None:
            graph.modules.append(
                [weakref.ref(t) for t in [*module.parameters(), *module.buffers()]]
            )
    graph.loads_checked = loads_so_far
    graph.versions = graph.input_versions()


def hyperparameter_finding(
    graph: Graph, built_at: Mapping[Optimizer, Location | None]
) -> Finding | None:
    """LR_BAKED_INTO_GRAPH for the first hyper-parameter that differs from the recorded one."""
    if "lr" in graph.reported:
        return None
    for ref, groups in zip(graph.optimizers, graph.hyper, strict=False):
        opt = ref()
        if (
            opt is None
            or id(opt) in graph.loaded_optimizers
            or len(opt.param_groups) != len(groups)
        ):
            continue  # a load is reported as replaced state
        for index, (group, captured) in enumerate(zip(opt.param_groups, groups, strict=True)):
            for key, before in captured.items():
                after = group.get(key)
                if after is before or not _differs(before, after):
                    continue
                graph.reported.add("lr")
                name = type(opt).__name__
                return Finding(
                    Code.LR_BAKED_INTO_GRAPH,
                    f"`{name}.param_groups[{index}]['{key}']` was {_show(before)} when "
                    f"{graph.where()} was recorded and is {_show(after)} now; the "
                    "replays keep using the recorded value",
                    "construct the optimizer with the learning rate in a device tensor "
                    "(`lr=torch.tensor(1e-3, device=device)`, with `capturable=True` "
                    "for Adam/AdamW) so a scheduler's in-place updates reach the graph; "
                    "any other hyper-parameter that changes needs a new capture",
                    subject=f"`{name}`",
                    location=built_at.get(opt),
                )
    return None


def replaced_state_findings(graph: Graph, new_loads: list[StateLoad]) -> list[Finding]:
    """OPTIMIZER_STATE_REPLACED for optimizer state or module tensors that a load replaced."""
    findings: list[Finding] = []
    optimizer_load = next((x for x in reversed(new_loads) if x.optimizer), None)
    module_load = next((x for x in reversed(new_loads) if not x.optimizer), None)
    replaced_opt = any(
        opt.state.get(p, {}).get(key) is not value
        for ref, entries in zip(graph.optimizers, graph.state, strict=False)
        if (opt := ref()) is not None
        for p, key, value in entries
    )
    if replaced_opt and optimizer_load is not None and "opt-state" not in graph.reported:
        graph.reported.add("opt-state")
        findings.append(
            Finding(
                Code.OPTIMIZER_STATE_REPLACED,
                f"`load_state_dict` put new tensors in place of the optimizer state that "
                f"{graph.where()} reads and writes; the replays keep updating the old "
                "tensors and ignore the loaded values",
                "load checkpoints before capturing, or capture again after loading "
                "(or copy the loaded values into the existing state tensors with `copy_`)",
                subject="`optimizer.load_state_dict`",
                location=optimizer_load.location,
            )
        )
    now = [[*m.parameters(), *m.buffers()] for ref in graph.module_refs if (m := ref()) is not None]
    replaced_module = any(
        len(tensors) != len(refs) or any(r() is not t for r, t in zip(refs, tensors, strict=False))
        for refs, tensors in zip(graph.modules, now, strict=False)
    )
    if replaced_module and module_load is not None and "module-state" not in graph.reported:
        graph.reported.add("module-state")
        findings.append(
            Finding(
                Code.OPTIMIZER_STATE_REPLACED,
                f"`load_state_dict` replaced the model's parameter or buffer tensors that "
                f"{graph.where()} reads; the replays keep training the old tensors",
                "load weights in place (`load_state_dict` without `assign=True`) or before "
                "capturing, or capture again after loading",
                subject="`module.load_state_dict`",
                location=module_load.location,
            )
        )
    return findings


def input_finding(graph: Graph, where: Callable[[], Location | None]) -> Finding | None:
    """STATIC_INPUT_CHANGED when the graph's inputs were freed or not written since the
    previous replay; updates the versions the next replay is compared with."""
    if not graph.inputs or "inputs" in graph.reported:
        return None
    dead = [i for i in graph.inputs if i.tensor() is None]
    if dead:
        graph.reported.add("inputs")
        return Finding(
            Code.STATIC_INPUT_CHANGED,
            f"{dead[0].label}, an input of {graph.where()}, was freed after the "
            "capture; the replays read memory that may now hold other tensors",
            "keep the static input tensors alive while the graph is replayed and copy "
            "each batch into them with `copy_`",
            subject="`CUDAGraph.replay`",
            location=where(),
        )
    versions = graph.input_versions()
    previous, graph.versions = graph.versions, versions
    # The first replay may reuse the batch the capture recorded (its step was not applied
    # by recording); from the second on, each replay needs new data.
    if graph.replays < 2 or versions != previous:
        return None
    graph.reported.add("inputs")
    labels = ", ".join(i.label for i in graph.inputs)
    return Finding(
        Code.STATIC_INPUT_CHANGED,
        f"replay {graph.replays} of {graph.where()} read its inputs ({labels}) "
        "unchanged since the previous replay: the new batch went to other tensors, "
        "which the graph does not read",
        "copy each batch into the tensors the graph was captured with "
        "(`static_x.copy_(x)`) before `replay()`; assigning `static_x = x` only "
        "rebinds the name",
        subject="`CUDAGraph.replay`",
        location=where(),
    )


def _differs(before: Any, after: Any) -> bool:
    """Whether a replay reads another value than the optimizer now holds."""
    if isinstance(before, torch.Tensor):
        try:
            return bool(before.detach().cpu().ne(torch.as_tensor(after).cpu()).any())
        except Exception:
            return True
    if isinstance(after, torch.Tensor):
        return True  # the graph kept the number; the optimizer now has a tensor
    try:
        return bool(before != after)
    except Exception:
        return before is not after


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return f"tensor({value.detach().cpu().item():g})"
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value)
