"""A family of graphs of one step, one per input signature, sharing one memory pool.

`capture_step(max_graphs=N)`: after the first capture, a call whose signature no held
graph serves runs eagerly (a warm-up of that signature: lazy library work for the new
shapes happens outside any capture), and a later call with that signature, on a
decision point, records a graph of its own (`family_capture`). Up to N graphs are held;
beyond that, `beyond_max_graphs="evict"` releases the least recently replayed graph and
`"eager"` runs calls of further signatures eagerly. A signature whose capture failed
runs eagerly from then on. N=1 (the default) is the single graph.

Memory. Every graph of the family is captured into the same pool: the pool given as
`pool=`, or one made with `torch.cuda.graph_pool_handle()`, on the same capture stream
(torch asks for the same stream when a pool is shared). A capture into a shared pool may
reuse memory that earlier captures freed, so the family takes about the memory of its
largest graph rather than the sum. torch's condition for sharing a pool is that the
graphs never run concurrently and that no graph reads memory another one has since
reused (its own `make_graphed_callables` shares a pool only among callables replayed in
the order they were captured, because each one reads the previous one's outputs). Here
the replays run one at a time, in call order, on one stream, and no graph reads another
graph's memory: each reads its own static inputs (allocated outside the pool) and the
model, optimizer and reducer state (allocated during the eager warm-up, outside the
pool). What a graph leaves live in the pool is its outputs and, after a
`zero_grad(set_to_none=True)` inside the step, the gradients it allocated: another
graph's replay may overwrite those. So the contract of a single graph holds, stated
for the family: the step's outputs (and `param.grad` when the step sets it to None)
are valid until the next call; read or clone them before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from ..ddp.streams import can_run_graphs
from ..errors import usage_error
from ..inputs.arguments import Signature, TensorMeta

if TYPE_CHECKING:
    from ..cycle.step_state import Captured, StepStats

BeyondMaxGraphs = Literal["evict", "eager"]
BEYOND_MAX_GRAPHS = ("evict", "eager")
# Eager calls of a new signature before its capture: cuBLAS/cuDNN choose and allocate
# per shape on first use, which must not happen while recording.
SIGNATURE_WARMUP_CALLS = 1
# Unheld signatures remembered for their warm-up count; older ones start again.
_SEEN_LIMIT = 64


def check_family(api: str, max_graphs: object, beyond: object, on_input_change: object) -> None:
    """Raise the usage error for a wrong `max_graphs` / `beyond_max_graphs`."""
    if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
        raise usage_error(
            f"`{api}(max_graphs=...)`",
            f"expected an int >= 1, got {max_graphs!r}",
            "leave it out for one graph, or pass the number of input shapes to keep graphs for "
            "(e.g. the number of length buckets)",
        )
    if beyond not in BEYOND_MAX_GRAPHS:
        raise usage_error(
            f"`{api}(beyond_max_graphs=...)`",
            f"expected 'evict' or 'eager', got {beyond!r}",
            "'evict' releases the least recently used graph for a new signature; "
            "'eager' runs further signatures eagerly",
        )
    if max_graphs > 1 and on_input_change == "raise":
        raise usage_error(
            f"`{api}(max_graphs={max_graphs}, on_input_change='raise')`",
            "a family of graphs adds a graph for a new input signature, "
            "which `on_input_change='raise'` refuses",
            "use `on_input_change='eager'` with `max_graphs`, "
            "or `max_graphs=1` to refuse new signatures",
        )


def shared_pool(pool: Any, max_graphs: object, device: torch.device) -> Any:
    """The pool the family captures into: the user's, or a new one for a family on a GPU."""
    if pool is not None or not (isinstance(max_graphs, int) and max_graphs > 1):
        return pool
    if not can_run_graphs(device):
        return None
    with torch.cuda.device(device):
        return torch.cuda.graph_pool_handle()


def pool_bytes(pool: Any, device: torch.device) -> int | None:
    """Bytes the allocator holds in `pool` (its segments); None off CUDA or when unknown."""
    if pool is None or not can_run_graphs(device):
        return None
    try:
        segments = torch.cuda.memory._snapshot(device)["segments"]
        mine = [
            s["total_size"] for s in segments if tuple(s.get("segment_pool_id", ())) == tuple(pool)
        ]
    except (KeyError, TypeError, RuntimeError):
        return None
    return sum(mine) if mine else None


def describe(signature: Signature) -> str:
    """A short label of a signature: the shapes of its tensors."""
    return (
        " ".join("x".join(map(str, x.shape)) for x in signature.leaves if isinstance(x, TensorMeta))
        or "()"
    )


@dataclass
class _Seen:
    signature: Signature
    calls: int = 0


class GraphFamily:
    """The graphs held for one step, most recently used first, and what the next call
    needs: the graph that serves it, or whether it may add one."""

    def __init__(
        self, max_graphs: object, beyond: object, stats: StepStats, pool: Any, device: torch.device
    ) -> None:
        self.max_graphs = (
            max_graphs if isinstance(max_graphs, int) and not isinstance(max_graphs, bool) else 1
        )
        self.beyond = beyond
        self.pool = pool
        self.device = device
        self.members: list[Captured] = []
        self._stats = stats
        self._seen: list[_Seen] = []
        self._failed: list[Signature] = []
        self._candidate: _Seen | None = None  # the unheld signature of this call
        self._labels: dict[int, str] = {}  # by id of a held graph: built once, read per replay

    @property
    def enabled(self) -> bool:
        return self.max_graphs > 1

    def select(self, captured: Captured, leaves: list[Any], spec: Any) -> Captured:
        """The held graph that serves this call (moved to the front), else `captured`."""
        if not self.members:
            self._adopt(captured)
        self._candidate = None
        if not self.enabled:
            return captured
        for i, member in enumerate(self.members):
            if member.graph.serves(leaves, spec):
                if i:
                    self.members.insert(0, self.members.pop(i))
                return member
        if not any(f.matches(leaves, spec) for f in self._failed):
            self._candidate = self._note(leaves, spec)
        return self.members[0]

    def may_add(self) -> bool:
        """Whether this call may record a graph for its signature (before the ranks agree)."""
        c = self._candidate
        room = len(self.members) < self.max_graphs or self.beyond == "evict"
        return c is not None and room and c.calls > SIGNATURE_WARMUP_CALLS

    def expects_unserved(self) -> bool:
        """Whether a call no graph serves is a family warm-up (not worth a warning)."""
        return self._candidate is not None and (
            len(self.members) < self.max_graphs or self.beyond == "evict"
        )

    def add(self, captured: Captured) -> None:
        """Hold `captured` first; release the least recently used graph beyond the limit."""
        self._forget()
        self.members.insert(0, captured)
        while len(self.members) > self.max_graphs:
            self.members.pop().graph.release()
            self._stats.evictions += 1
        self._update()

    def failed(self) -> None:
        """This call's signature failed to capture on this rank: eager from now on."""
        if self._candidate is not None:
            self._failed.append(self._candidate.signature)
        self._forget()

    def replayed(self, captured: Captured) -> None:
        label = self._labels.get(id(captured)) or self._label(captured)
        self._stats.replays_per_graph[label] = self._stats.replays_per_graph.get(label, 0) + 1

    def release_all(self, keep: Captured | None) -> None:
        """Release every graph but `keep` (which its owner releases)."""
        for member in self.members:
            if member is not keep:
                member.graph.release()
        self.members = []
        self._labels = {}
        self._candidate = None
        self._stats.graphs = 0

    # ----------------------------------------------------------------- internals
    def _adopt(self, captured: Captured) -> None:
        self.members = [captured]
        self._update()

    def _note(self, leaves: list[Any], spec: Any) -> _Seen:
        for seen in self._seen:
            if seen.signature.matches(leaves, spec):
                seen.calls += 1
                return seen
        seen = _Seen(Signature(leaves, spec, []), 1)
        self._seen = [seen, *self._seen[: _SEEN_LIMIT - 1]]
        return seen

    def _forget(self) -> None:
        self._seen = [s for s in self._seen if s is not self._candidate]
        self._candidate = None

    def _label(self, captured: Captured) -> str:
        label = self._labels[id(captured)] = describe(captured.graph.signature)
        return label

    def _update(self) -> None:
        self._labels = {
            id(m): self._labels.get(id(m)) or describe(m.graph.signature) for m in self.members
        }
        self._stats.graphs = len(self.members)
        self._stats.pool_bytes = pool_bytes(self.pool, self.device)
