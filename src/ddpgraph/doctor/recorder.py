"""What one rank of a doctored script did, and the findings that follow from it.

The instrumentation (`instrument.py`) turns PyTorch calls into the events below, in call
order; the recorder keeps the bookkeeping (`observed.py`) and applies the rules
(`failure_rules.py` for a capture that raised or a script that failed, `replay_rules.py` at
each replay), so the rules can be tested by driving the events directly, without a GPU:

* a DDP model: where and on which stream it was built, how many forwards its reducer
  counted (`ddpgraph.ddp.build.ForwardCounter`), how many of them a backward followed;
* a capture: where it began, which DDP forwards and optimizer steps it recorded, which
  tensors from before the capture its DDP forwards read (its inputs);
* a replay: whether hyper-parameters held as Python numbers changed since the capture,
  whether state the graph reads was replaced by `load_state_dict`, whether the inputs
  were written since the previous replay;
* a write into a tensor that raised (after a capture): whether the tensor is a graph's
  input, so that a batch of another shape is told from any other failed copy;
* ddpgraph's own decisions (a captured step that gave up, a call its graph could not
  serve, a non-finite loss), each with the finding ddpgraph made;
* the DDP gradient synchronisations this rank ran, eagerly or replayed, which the
  report compares between ranks.

Silent findings (a replay that cannot do what the script expects) are reported at the
first replay that shows them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from ..findings import Code, Finding, Location
from ..probe.diagnose import error_chain
from ..probe.syncs import SyncEvent
from . import replay_rules
from .failure_rules import (
    capture_failure_findings,
    no_gpu_finding,
    raised_by_cuda,
    script_error_finding,
)
from .observed import (
    DdpForward,
    DdpModel,
    Graph,
    GraphInput,
    StateLoad,
    StreamInfo,
    storage_key,
)
from .records import GraphCounts, RankRecord, RankStatus


class Recorder:
    """Bookkeeping for one rank. Events come from the instrumentation, in call order."""

    def __init__(
        self, rank: int = 0, world_size: int = 1, on_change: Callable[[], None] | None = None
    ):
        self.rank = rank
        self.world_size = world_size
        self.findings: list[Finding] = []
        self.counts = GraphCounts()
        self.ddp_counts = GraphCounts()
        self._on_change = on_change or (lambda: None)
        self._ddps: weakref.WeakKeyDictionary[torch.nn.Module, DdpModel] = (
            weakref.WeakKeyDictionary()
        )
        self._optimizers_built: weakref.WeakKeyDictionary[Optimizer, Location | None] = (
            weakref.WeakKeyDictionary()
        )
        self._graphs: weakref.WeakKeyDictionary[Any, Graph] = weakref.WeakKeyDictionary()
        self._capturing: Graph | None = None
        self._graph_count = 0
        self._loads: list[StateLoad] = []
        self._diagnosed: list[BaseException] = []
        # DDP gradient synchronisations run: eager iterations, plus the DDP forwards
        # each replay repeats. Ranks whose counts agree paired every all-reduce.
        self.collective_steps = 0
        self._backward_stream: StreamInfo | None = None
        self._failed_writes: list[tuple[BaseException, Finding]] = []
        self._cuda_errors: list[BaseException] = []
        # Calls of a ddpgraph step that its graph could not serve, by code: (count, first).
        self._unserved: dict[Code, tuple[int, Finding]] = {}

    # ------------------------------------------------------------------ state
    @property
    def capturing_graph(self) -> Graph | None:
        """The graph being recorded now, None while none is."""
        return self._capturing

    @property
    def captured_any(self) -> bool:
        return self._graph_count > 0

    @property
    def has_ddp(self) -> bool:
        return len(self._ddps) > 0

    def record(
        self, status: RankStatus = RankStatus.RUNNING, exit_code: int | None = None
    ) -> RankRecord:
        return RankRecord(
            self.rank,
            self.world_size,
            status=status,
            exit_code=exit_code,
            findings=list(self.findings),
            graphs=GraphCounts(**vars(self.counts)),
            ddp_graphs=GraphCounts(**vars(self.ddp_counts)),
            collective_steps=self.collective_steps,
        )

    def add(self, finding: Finding) -> None:
        """Add a finding once (the same code, text and place count once)."""
        key = (finding.code, finding.happened, finding.location)
        if all((f.code, f.happened, f.location) != key for f in self.findings):
            self.findings.append(finding)
            self._on_change()

    # ------------------------------------------------------------------ DDP and training
    def ddp_built(
        self, module: torch.nn.Module, location: Location | None, stream: StreamInfo | None
    ) -> None:
        self._ddps[module] = DdpModel(location, stream)

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
            graph.forwards.append(DdpForward(ddp, ddp.counter.count, ddp.iterations))
        if module not in [m() for m in graph.module_refs]:
            graph.module_refs.append(weakref.ref(module))
        self._track_inputs(graph, args)

    def backward(self, stream: StreamInfo | None = None) -> None:
        """A backward ran, on `stream` (the current CUDA stream, None off CUDA)."""
        if self._capturing is None and self._backward_stream is None:
            self._backward_stream = stream
        for ddp in self._ddps.values():
            if ddp.awaiting_backward:
                ddp.iterations += 1
                ddp.awaiting_backward = False
                if self._capturing is None:
                    self.collective_steps += 1

    def optimizer_built(self, optimizer: Optimizer, location: Location | None) -> None:
        self._optimizers_built[optimizer] = location

    def optimizer_step(self, optimizer: Optimizer) -> None:
        graph = self._capturing
        if graph is not None and all(r() is not optimizer for r in graph.optimizers):
            graph.optimizers.append(weakref.ref(optimizer))

    def state_loaded(self, target: Any, location: Location | None) -> None:
        self._loads.append(StateLoad(weakref.ref(target), isinstance(target, Optimizer), location))

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
        mode: str = "global",
    ) -> None:
        """A capture begins on this thread, in CUDA's capture `mode`."""
        self._graph_count += 1
        # Only DDP forwards' inputs are tracked: the scan is skipped without DDP.
        preexisting = live_storages() if self.has_ddp else set()
        number, backward = self._graph_count, self._backward_stream
        self._capturing = Graph(number, location, stream, backward, preexisting, mode=mode)
        self._graphs[graph] = self._capturing

    def capture_end(
        self, graph: Any, errors: Sequence[BaseException], syncs: Sequence[SyncEvent] = ()
    ) -> None:
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
            for finding in capture_failure_findings(current, errors, syncs):
                self.add(finding)
        else:
            for c in counts:
                c.captured += 1
                c.capture_location = c.capture_location or current.location
            replay_rules.remember_captured_state(current, len(self._loads))
        self._on_change()

    def _track_inputs(self, graph: Graph, args: Sequence[Any]) -> None:
        for index, arg in enumerate(args):
            if not isinstance(arg, torch.Tensor) or arg.requires_grad:
                continue
            key = storage_key(arg)
            if key is None or key not in graph.preexisting:
                continue  # made during the capture: the graph owns it
            # A view made inside the capture (`seq[:, :-1]` of a static batch) dies when the
            # capture ends while its storage lives on: what must stay alive is its base.
            owner = arg if arg._base is None else arg._base
            if any(i.tensor() is owner for i in graph.inputs):
                continue
            shape = "x".join(str(s) for s in arg.shape) or "scalar"
            dtype = str(arg.dtype).replace("torch.", "")
            graph.inputs.append(
                GraphInput(weakref.ref(owner), f"DDP forward argument {index} ({shape} {dtype})")
            )

    # ------------------------------------------------------------------ replay
    def replay(self, graph: Any, where: Callable[[], Location | None]) -> None:
        info = self._graphs.get(graph)
        if info is None:
            return
        info.replays += 1
        self.counts.replays += 1
        self.collective_steps += len(info.forwards)
        if info.has_ddp:
            self.ddp_counts.replays += 1
        new_loads = self._loads[info.loads_checked :]
        info.loads_checked = len(self._loads)
        info.loaded_optimizers.update(id(x.target()) for x in new_loads if x.optimizer)
        findings = [replay_rules.hyperparameter_finding(info, self._optimizers_built)]
        if new_loads:
            findings += replay_rules.replaced_state_findings(info, new_loads)
        findings.append(replay_rules.input_finding(info, where))
        for finding in findings:
            if finding is not None:
                self.add(finding)

    # ------------------------------------------------------------------ writes
    @property
    def has_graph_inputs(self) -> bool:
        return any(g.inputs for g in self._graphs.values())

    def failed_write(
        self,
        target: torch.Tensor,
        value: Any,
        written_shape: tuple[int, ...] | None,
        error: BaseException,
        where: Location | None,
    ) -> None:
        """Writing `value` into `target` (into its part of shape `written_shape`) raised
        `error`: a STATIC_INPUT_CHANGED if `target` is a captured graph's input and
        `value` a tensor of another shape than the part written."""
        key = storage_key(target)
        if key is None or not isinstance(value, torch.Tensor) or written_shape is None:
            return
        if tuple(value.shape) == tuple(written_shape):
            return
        for graph in self._graphs.values():
            found = graph.input_named(key) if graph.versions is not None else None
            if found is None:
                continue
            self._failed_writes.append(
                (error, _misfit_write(found.label, graph.where(), value, written_shape, where))
            )
            return

    # ------------------------------------------------------------------ ddpgraph's own steps
    def ddpgraph_gave_up(self, finding: Finding, where: Location | None) -> None:
        """A ddpgraph step stopped capturing, for `finding` (agreed by every rank)."""
        if finding.code is Code.NO_CUDA and not torch.cuda.is_available():
            self.add(
                no_gpu_finding(
                    "the ddpgraph step here ran every call eagerly, capturing nothing", where
                )
            )
            return
        if any(f.code is finding.code for f in self.findings):
            return  # the failed capture itself was diagnosed here already
        self.add(
            Finding(
                finding.code,
                finding.happened,
                finding.fix,
                finding.subject,
                finding.location or where,
            )
        )

    def ddpgraph_captured_again(self, finding: Finding, where: Location | None) -> None:
        """A ddpgraph step captured again: a finding when its graph replayed a frozen value."""
        if finding.code is Code.FROZEN_PYTHON_VALUE:
            self.ddpgraph_gave_up(finding, where)

    def unserved_call(self, finding: Finding, where: Location | None) -> None:
        """A call a ddpgraph step's graph could not serve ran eagerly."""
        previous = self._unserved.get(finding.code)
        first = (
            previous[1]
            if previous
            else Finding(
                finding.code,
                finding.happened,
                finding.fix,
                finding.subject,
                finding.location or where,
            )
        )
        self._unserved[finding.code] = ((previous[0] if previous else 0) + 1, first)
        # What the script changed on the model after capture is its mistake to report;
        # a batch of another shape (INPUT_SIGNATURE_CHANGED) is only counted.
        if finding.code in (Code.MODEL_MODE_CHANGED, Code.MODULE_SETTING_CHANGED):
            self.add(first)

    def nonfinite(self, finding: Finding, where: Location | None) -> None:
        self.add(Finding(finding.code, finding.happened, finding.fix, finding.subject, where))

    def cuda_error(self, error: BaseException) -> None:
        """`error` came from asking for CUDA (an NCCL process group) without a GPU."""
        self._cuda_errors.append(error)

    # ------------------------------------------------------------------ the script's end
    def script_ended(self) -> None:
        """Findings that need the whole run: a captured step whose graph served fewer
        calls than ran eagerly because their inputs changed gains nothing from it."""
        entry = self._unserved.get(Code.INPUT_SIGNATURE_CHANGED)
        if entry is None:
            return
        count, first = entry
        replays = self.counts.replays
        if count > replays:
            self.add(
                Finding(
                    first.code,
                    f"{count} calls ran eagerly because their inputs differed from the captured "
                    f"ones, and the graph replayed {replays} times; the first: "
                    f"{first.happened}",
                    "give every call the captured shapes (pad variable lengths to a few fixed "
                    "sizes, `drop_last=True`), or use `ddpgraph.make_step(..., "
                    'strategy="partial")` or `torch.compile`, which handle changing shapes',
                    first.subject,
                    first.location,
                )
            )

    def script_error(self, error: BaseException) -> None:
        """The script raised `error` out of its top level (or exited with it)."""
        chain = error_chain(error)
        if any(link is seen for link in chain for seen in self._diagnosed):
            return  # the failed capture it came from is reported
        code = getattr(getattr(error, "finding", None), "code", None)
        if code is not None and any(f.code is code for f in self.findings):
            return  # ddpgraph's error for a decision reported when it was made
        write = next((f for e, f in self._failed_writes for link in chain if link is e), None)
        no_gpu = not torch.cuda.is_available() and (
            raised_by_cuda(error) or any(link is e for link in chain for e in self._cuda_errors)
        )
        self.add(script_error_finding(error, input_write=write, needs_gpu=no_gpu))


def _misfit_write(
    label: str,
    graph: str,
    value: torch.Tensor,
    written_shape: tuple[int, ...],
    where: Location | None,
) -> Finding:
    """STATIC_INPUT_CHANGED: `value` did not fit the part of graph input `label` written."""
    shape = "x".join(str(s) for s in value.shape) or "scalar"
    return Finding(
        Code.STATIC_INPUT_CHANGED,
        f"a tensor of shape {shape} was written into {label}, an input of {graph}, where it "
        f"does not fit ({'x'.join(str(s) for s in written_shape) or 'scalar'} expected)",
        "a graph replays the shapes it was captured with: keep every batch the "
        "same shape (`drop_last=True` in the DataLoader) and run an odd batch "
        "eagerly, or capture one graph per shape",
        subject="graph input",
        location=where,
    )
