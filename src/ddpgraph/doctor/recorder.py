"""What one rank of a doctored script did, and the findings that follow from it.

The instrumentation (`instrument.py`) turns PyTorch calls into the events below; this
module keeps the bookkeeping and applies the rules, so the rules can be tested by
driving the events directly, without a GPU:

* a DDP model: where and on which stream it was built, how many forwards its reducer
  counted (`ddpgraph.ddp.ForwardCounter`), how many of them a backward followed;
* a capture: where it began, which DDP forwards and optimizer steps it recorded, which
  tensors from before the capture its DDP forwards read (its inputs);
* a replay: whether hyper-parameters held as Python numbers changed since the capture,
  whether state the graph reads was replaced by `load_state_dict`, whether the inputs
  were written since the previous replay.

Failure findings (a capture that raised) come from this rank's own evidence first and
from `ddpgraph.diagnose` for the rest; silent ones (a replay that cannot do what the
script expects) are reported at the first replay that shows them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim import Optimizer

from ..ddp import ForwardCounter
from ..diagnose import capture_findings, error_chain, error_location, first_line
from ..findings import Code, Finding, Location
from ..optim import NOT_HYPERPARAMETERS
from ..probe import SyncEvent
from ..warmup import MIN_WARMUP_ITERATIONS, is_capturable_forward, steps_until_capturable
from .records import GraphCounts, RankRecord, RankStatus

_SHAPE_MISMATCH = ("must match the size", "match the broadcast shape", "size mismatch")


@dataclass(frozen=True)
class StreamInfo:
    id: int
    is_default: bool


@dataclass
class _Ddp:
    built_at: Location | None
    built_on: StreamInfo | None
    counter: ForwardCounter = field(default_factory=ForwardCounter)
    iterations: int = 0  # counted forwards that a backward followed
    awaiting_backward: bool = False


@dataclass(frozen=True)
class _Forward:
    ddp: _Ddp
    number: int  # the reducer's count for this forward, 1-based
    iterations_before: int


@dataclass
class _Input:
    tensor: weakref.ref[torch.Tensor]
    label: str


@dataclass
class _Graph:
    number: int
    location: Location | None
    stream: StreamInfo | None
    preexisting: set[int] = field(default_factory=set)
    forwards: list[_Forward] = field(default_factory=list)
    optimizers: list[weakref.ref[Optimizer]] = field(default_factory=list)
    inputs: list[_Input] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    hyper: list[list[dict[str, Any]]] = field(default_factory=list)  # per optimizer, per group
    state: list[list[tuple[Any, str, Any]]] = field(default_factory=list)  # (param, key, tensor)
    modules: list[list[weakref.ref[torch.Tensor]]] = field(default_factory=list)
    module_refs: list[weakref.ref[torch.nn.Module]] = field(default_factory=list)
    versions: tuple[int, ...] | None = None
    replays: int = 0
    loads_checked: int = 0
    loaded_optimizers: set[int] = field(default_factory=set)  # ids loaded after capture
    reported: set[str] = field(default_factory=set)

    @property
    def has_ddp(self) -> bool:
        """Whether it recorded a DDP forward that syncs gradients (so, an all-reduce)."""
        return bool(self.forwards)

    def where(self) -> str:
        return f"graph {self.number}" + (f" (captured at {self.location})" if self.location else "")


@dataclass(frozen=True)
class _Load:
    target: weakref.ref[Any]
    optimizer: bool
    location: Location | None


def storage_key(tensor: torch.Tensor) -> int | None:
    """The address of the tensor's storage: views of one tensor share it."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except Exception:  # tensor subclasses without storage
        return None


class Recorder:
    """Bookkeeping for one rank. Events come from the instrumentation, in call order."""

    def __init__(self, rank: int = 0, world_size: int = 1, on_change: Callable[[], None] | None = None):
        self.rank = rank
        self.world_size = world_size
        self.findings: list[Finding] = []
        self.counts = GraphCounts()
        self.ddp_counts = GraphCounts()
        self._on_change = on_change or (lambda: None)
        self._ddps: weakref.WeakKeyDictionary[torch.nn.Module, _Ddp] = weakref.WeakKeyDictionary()
        self._optimizers_built: weakref.WeakKeyDictionary[Optimizer, Location | None] = (
            weakref.WeakKeyDictionary()
        )
        self._graphs: weakref.WeakKeyDictionary[Any, _Graph] = weakref.WeakKeyDictionary()
        self._capturing: _Graph | None = None
        self._graph_count = 0
        self._loads: list[_Load] = []
        self._diagnosed: list[BaseException] = []

    # ------------------------------------------------------------------ state
    @property
    def capturing(self) -> bool:
        return self._capturing is not None

    @property
    def captured_any(self) -> bool:
        return self._graph_count > 0

    @property
    def has_ddp(self) -> bool:
        return len(self._ddps) > 0

    def record(self, status: RankStatus = RankStatus.RUNNING, exit_code: int | None = None) -> RankRecord:
        return RankRecord(
            self.rank,
            self.world_size,
            status=status,
            exit_code=exit_code,
            findings=list(self.findings),
            graphs=GraphCounts(**vars(self.counts)),
            ddp_graphs=GraphCounts(**vars(self.ddp_counts)),
        )

    def add(self, finding: Finding) -> None:
        """Add a finding once (the same code, text and place count once)."""
        key = (finding.code, finding.happened, finding.location)
        if all((f.code, f.happened, f.location) != key for f in self.findings):
            self.findings.append(finding)
            self._on_change()

    # ------------------------------------------------------------------ DDP and training
    def ddp_built(self, module: torch.nn.Module, location: Location | None, stream: StreamInfo | None) -> None:
        self._ddps[module] = _Ddp(location, stream)

    def ddp_forward(self, module: torch.nn.Module, args: Sequence[Any]) -> None:
        ddp = self._ddps.get(module)
        if ddp is None:
            return
        before = ddp.counter.count
        ddp.counter(module, args)
        counted = ddp.counter.count > before
        if counted:
            ddp.awaiting_backward = True
        graph = self._capturing
        if graph is None:
            return
        if counted:
            graph.forwards.append(_Forward(ddp, ddp.counter.count, ddp.iterations))
        if module not in [m() for m in graph.module_refs]:
            graph.module_refs.append(weakref.ref(module))
        self._track_inputs(graph, args)

    def backward(self) -> None:
        for ddp in self._ddps.values():
            if ddp.awaiting_backward:
                ddp.iterations += 1
                ddp.awaiting_backward = False

    def optimizer_built(self, optimizer: Optimizer, location: Location | None) -> None:
        self._optimizers_built[optimizer] = location

    def optimizer_step(self, optimizer: Optimizer) -> None:
        graph = self._capturing
        if graph is not None and all(r() is not optimizer for r in graph.optimizers):
            graph.optimizers.append(weakref.ref(optimizer))

    def state_loaded(self, target: Any, location: Location | None) -> None:
        self._loads.append(_Load(weakref.ref(target), isinstance(target, Optimizer), location))

    def warning(self, text: str) -> None:
        if self._capturing is not None:
            self._capturing.warnings.append(text)

    # ------------------------------------------------------------------ capture
    def capture_begin(
        self,
        graph: Any,
        location: Location | None,
        stream: StreamInfo | None,
        live_storages: Callable[[], set[int]] = set,
    ) -> None:
        self._graph_count += 1
        # Only DDP forwards' inputs are tracked: the scan is skipped without DDP.
        preexisting = live_storages() if self.has_ddp else set()
        self._capturing = _Graph(self._graph_count, location, stream, preexisting)
        self._graphs[graph] = self._capturing

    def capture_end(self, graph: Any, errors: Sequence[BaseException], syncs: Sequence[SyncEvent] = ()) -> None:
        current = self._graphs.get(graph, self._capturing)
        self._capturing = None
        if current is None:
            return
        current.preexisting = set()
        counts = [self.counts, self.ddp_counts] if current.has_ddp else [self.counts]
        if errors:
            for c in counts:
                c.failed += 1
            for error in errors:
                self._diagnosed.extend(error_chain(error))
            for finding in self._failure_findings(current, errors, syncs):
                self.add(finding)
        else:
            for c in counts:
                c.captured += 1
                c.capture_location = c.capture_location or current.location
            self._remember_captured_state(current)
        self._on_change()

    def _failure_findings(
        self, graph: _Graph, errors: Sequence[BaseException], syncs: Sequence[SyncEvent]
    ) -> list[Finding]:
        known: list[Finding] = []
        for ddp in {id(f.ddp): f.ddp for f in graph.forwards}.values():
            if ddp.built_on is not None and ddp.built_on.is_default:
                known.append(
                    Finding(
                        Code.DDP_STREAM_MISMATCH,
                        "DistributedDataParallel was built on the default CUDA stream, so its "
                        "gradient accumulators belong to that stream; backward inside the "
                        "capture then makes the default stream wait on the capture stream, "
                        "which invalidates the capture",
                        "build DDP inside `with torch.cuda.stream(s):` on a side stream `s`, "
                        "warm up on `s`, and capture with `torch.cuda.graph(g, stream=s)` "
                        "(or use `ddpgraph.prepare_ddp`)",
                        subject="`DistributedDataParallel(...)`",
                        location=ddp.built_at,
                    )
                )
        for forward in graph.forwards:
            finding = _warmup_finding(forward, graph.location)
            if finding is not None:
                known.append(finding)
                break
        return capture_findings(errors, graph.warnings, syncs, known=known)

    def _track_inputs(self, graph: _Graph, args: Sequence[Any]) -> None:
        for index, arg in enumerate(args):
            if not isinstance(arg, torch.Tensor) or arg.requires_grad:
                continue
            key = storage_key(arg)
            if key is None or key not in graph.preexisting:
                continue  # made during the capture: the graph owns it
            if any(i.tensor() is arg for i in graph.inputs):
                continue
            shape = "x".join(str(s) for s in arg.shape) or "scalar"
            dtype = str(arg.dtype).replace("torch.", "")
            graph.inputs.append(_Input(weakref.ref(arg), f"DDP forward argument {index} ({shape} {dtype})"))

    def _remember_captured_state(self, graph: _Graph) -> None:
        for ref in graph.optimizers:
            opt = ref()
            if opt is None:
                continue
            graph.hyper.append(
                [{k: v for k, v in g.items() if k not in NOT_HYPERPARAMETERS} for g in opt.param_groups]
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
                tensors = [*module.parameters(), *module.buffers()]
                graph.modules.append([weakref.ref(t) for t in tensors])
        graph.loads_checked = len(self._loads)
        graph.versions = _versions(graph)

    # ------------------------------------------------------------------ replay
    def replay(self, graph: Any, where: Callable[[], Location | None]) -> None:
        info = self._graphs.get(graph)
        if info is None:
            return
        info.replays += 1
        self.counts.replays += 1
        if info.has_ddp:
            self.ddp_counts.replays += 1
        new_loads = self._loads[info.loads_checked :]
        info.loads_checked = len(self._loads)
        info.loaded_optimizers.update(id(x.target()) for x in new_loads if x.optimizer)
        if "lr" not in info.reported:
            self._check_hyperparameters(info)
        if new_loads:
            self._check_replaced_state(info, new_loads)
        self._check_inputs(info, where)

    def _check_hyperparameters(self, graph: _Graph) -> None:
        for ref, groups in zip(graph.optimizers, graph.hyper, strict=False):
            opt = ref()
            if opt is None or id(opt) in graph.loaded_optimizers or len(opt.param_groups) != len(groups):
                continue  # a load is reported as replaced state
            for index, (group, captured) in enumerate(zip(opt.param_groups, groups, strict=True)):
                for key, before in captured.items():
                    after = group.get(key)
                    if after is before or not _differs(before, after):
                        continue
                    graph.reported.add("lr")
                    name = type(opt).__name__
                    self.add(
                        Finding(
                            Code.LR_BAKED_INTO_GRAPH,
                            f"`{name}.param_groups[{index}]['{key}']` was {_show(before)} when "
                            f"{graph.where()} was recorded and is {_show(after)} now; the "
                            "replays keep using the recorded value",
                            "construct the optimizer with the learning rate in a device tensor "
                            "(`lr=torch.tensor(1e-3, device=device)`, with `capturable=True` "
                            "for Adam/AdamW) so a scheduler's in-place updates reach the graph; "
                            "any other hyper-parameter that changes needs a new capture",
                            subject=f"`{name}`",
                            location=self._optimizers_built.get(opt),
                        )
                    )
                    return

    def _check_replaced_state(self, graph: _Graph, new_loads: list[_Load]) -> None:
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
            self.add(
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
        now = [
            [*m.parameters(), *m.buffers()] for ref in graph.module_refs if (m := ref()) is not None
        ]
        replaced_module = any(
            len(tensors) != len(refs) or any(r() is not t for r, t in zip(refs, tensors, strict=False))
            for refs, tensors in zip(graph.modules, now, strict=False)
        )
        if replaced_module and module_load is not None and "module-state" not in graph.reported:
            graph.reported.add("module-state")
            self.add(
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

    def _check_inputs(self, graph: _Graph, where: Callable[[], Location | None]) -> None:
        if not graph.inputs or "inputs" in graph.reported:
            return
        dead = [i for i in graph.inputs if i.tensor() is None]
        if dead:
            graph.reported.add("inputs")
            self.add(
                Finding(
                    Code.STATIC_INPUT_CHANGED,
                    f"{dead[0].label}, an input of {graph.where()}, was freed after the "
                    "capture; the replays read memory that may now hold other tensors",
                    "keep the static input tensors alive while the graph is replayed and copy "
                    "each batch into them with `copy_`",
                    subject="`CUDAGraph.replay`",
                    location=where(),
                )
            )
            return
        versions = _versions(graph)
        # The first replay may reuse the batch the capture recorded (its step was not
        # applied by recording); from the second on, each replay needs new data.
        if graph.replays >= 2 and versions == graph.versions:
            graph.reported.add("inputs")
            labels = ", ".join(i.label for i in graph.inputs)
            self.add(
                Finding(
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
            )
        graph.versions = versions

    # ------------------------------------------------------------------ the script's end
    def script_error(self, error: BaseException) -> None:
        """The script raised `error` out of its top level (or exited with it)."""
        chain = error_chain(error)
        if any(link is seen for link in chain for seen in self._diagnosed):
            return  # the failed capture it came from is reported
        where = error_location(error)
        if isinstance(error, SystemExit):
            self.add(
                Finding(
                    Code.SCRIPT_FAILED,
                    f"the script exited with status {error.code!r}",
                    subject="`sys.exit`",
                    location=where,
                )
            )
            return
        text = str(error)
        copying = where is not None and ".copy_(" in where.source
        if self.counts.captured and copying and any(m in text for m in _SHAPE_MISMATCH):
            self.add(
                Finding(
                    Code.STATIC_INPUT_CHANGED,
                    f"a batch of another shape was copied into a captured input: {first_line(error)}",
                    "a graph replays fixed shapes: keep every batch the same shape (for example "
                    "`drop_last=True` in the DataLoader) or run the odd batch eagerly",
                    subject="static input `copy_`",
                    location=where,
                )
            )
            return
        self.add(Finding(Code.SCRIPT_FAILED, first_line(error), location=where))


def _warmup_finding(forward: _Forward, capture_at: Location | None) -> Finding | None:
    k, done = forward.number, forward.iterations_before
    if done >= MIN_WARMUP_ITERATIONS and is_capturable_forward(k):
        return None
    needed = max(MIN_WARMUP_ITERATIONS, k - 1 + steps_until_capturable([k - 1], 1))
    return Finding(
        Code.WARMUP_TOO_SHORT,
        f"the capture recorded DDP forward number {k}, after {done} iteration"
        f"{'' if done == 1 else 's'} with backward; DDP's reducer needs {needed} before a "
        "capture (it rebuilds buckets on iteration 2 and synchronises with the host to sample "
        "statistics on iterations 1-10 and every 100th)",
        f"run at least {needed} full iterations (forward and backward, grad enabled) on the "
        "capture stream before capturing, and do not capture on an iteration n with "
        "n % 100 in (0, 1)",
        subject="capture",
        location=capture_at,
    )


def _versions(graph: _Graph) -> tuple[int, ...]:
    return tuple(t._version if (t := i.tensor()) is not None else -1 for i in graph.inputs)


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
