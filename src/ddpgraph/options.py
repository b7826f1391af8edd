"""The capture settings of a step, in one object, checked in one place.

Every entry point (`capture_step`, `make_step`, `capture_eval`, the integrations) takes
the settings either as one `CaptureOptions` (`options=`) or as keyword arguments of the
same names (`CaptureSettings`), and `merge_settings` turns them into one `CaptureOptions`;
everything behind the entry points passes that object. `check` raises the usage error for
a wrong value; a step calls it inside its constructor's agreement, so that a value wrong
on one rank only makes every rank raise.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
from torch import nn
from torch.optim import Optimizer
from typing_extensions import TypedDict

from .backends.graph import GraphBackend
from .cycle.fallback import OnFailure, check_policies
from .ddp import build as ddp_tools
from .ddp.streams import can_run_graphs
from .errors import DdpGraphUsageError, usage_error
from .family.graphs import BeyondMaxGraphs, check_family
from .findings import Code, Finding
from .frozen.value_checks import DEFAULT_VERIFY_EVERY
from .step.parity import ParityCheck, as_parity_check
from .step.snapshot import Restorable
from .watchdog.watch import check_options as check_watchdog_options

# Calls between two agreements of a captured step on a DDP model (see `engine`).
DEFAULT_AGREE_EVERY = 100
# What `torch.cuda.graph_pool_handle()` returns (torch types it as a NewType of this).
PoolHandle = tuple[int, int]
ReplayTimeout = float | Literal["group"] | None
OnReplayTimeout = Literal["abort", "report"]


@dataclass(frozen=True)
class CaptureOptions:
    """How a step is captured and replayed: every setting of `capture_step` besides the
    step function, the model, the optimizers and `compile`. Pass one as `options=` to
    `capture_step`, `make_step`, `capture_eval` or an integration, or give the same
    settings as keyword arguments; `dataclasses.replace(options, warmup_steps=5)` changes one.

    Attributes:
        warmup_steps: eager calls before capture; at least 1, and at least what DDP needs.
            None: as many as DDP's reducer needs (11 for a fresh model).
        on_failure: "eager": if capture is refused or fails on any rank, all ranks run
            every later step eagerly, and `reason` says why; "raise": all ranks raise
            `DdpGraphError` instead. Either way model, optimizer and RNG are left exactly
            where eager training would have them.
        on_input_change: a call whose arguments differ from the captured ones (shapes,
            dtypes, devices, structure, non-tensor values) is never replayed: "eager" runs
            it eagerly and warns once; "raise" raises `DdpGraphError`. The eager call is
            local to the rank that sees the change (an eager step runs the same
            collectives in the same order as a replay, so ranks stay paired); "raise" is
            agreed: every rank raises on the same call, the next decision point (see
            `agree_every`), and the rank that saw it runs eagerly until then.
        clone_outputs: True (default): a replay returns copies of the graph's output
            tensors (one device copy per output), so what one call returned keeps its
            values after the next, as in eager training: losses kept in a list to be
            read every few steps stay right. False returns the graph's own tensors,
            overwritten by the next replay (read or clone them before the next call),
            and saves the copies.
        stream: the stream you built DDP on, if you built it yourself inside
            `torch.cuda.stream(stream)` rather than with `prepare_ddp`.
        pool: a graph memory pool (`torch.cuda.graph_pool_handle()`) to share with other
            graphs that never run concurrently with this one.
        backend: the graph backend; None picks CUDA graphs when the model is on a GPU.
            `ddpgraph.PassThroughBackend()` runs the whole state machine on CPU.
        generators: `torch.Generator` objects the step draws from besides the default
            one (`torch.randn(..., generator=g)`): registered with the graph, so that each
            replay draws fresh numbers from them and advances them as eager steps would.
        scaler: the `ddpgraph.GraphSafeGradScaler` the step uses, so that a failed (or
            stand-in) recording leaves its state as eager training would.
        agree_every: on a DDP model over several processes, the ranks agree on what
            their guards saw every this many calls once captured; a rank that saw
            something runs eager steps until then, which pair with the peers' replays.
            Smaller reacts sooner; each agreement is one small collective.
        replay_timeout, on_replay_timeout: a replay not finished this many seconds after
            it could start ("group": the process group's timeout; None: not watched) is
            reported (REPLAY_TIMED_OUT), then ("abort") the process group is aborted and
            the process fails; "report" only logs. See `ddpgraph.watchdog.watch`.
        max_graphs, beyond_max_graphs: hold up to `max_graphs` graphs, one per input
            signature, in one memory pool; beyond them "evict" the least recently used or
            run "eager" (see `ddpgraph.family.graphs`, docs/variable_shapes.md, `pad_to_bucket`).
        parity: `ddpgraph.ParityCheck(rtol=...)` (or True: bit-for-bit): on the call that
            captures, run the step once eagerly and once replayed from the same saved state
            and compare parameters and outputs on every rank; a difference beyond `rtol` on
            any rank is a PARITY_MISMATCH finding, answered by `on_failure` on all ranks.
        verify_every: every this many calls after the capturing one, serve the call with
            a watched eager step instead of a replay, on every rank, and compare the Python
            values it passes to torch (numbers, sizes, the functions a branch calls) with
            the last warm-up call's; a difference (a flag set at step 1000, a curriculum
            switch) is FROZEN_PYTHON_VALUE, and the step is captured again on every rank
            (given up under `on_failure="raise"`). None never checks: each check costs an
            eager step (docs/training.md has the cost).
    """

    warmup_steps: int | None = None
    on_failure: OnFailure = "eager"
    on_input_change: OnFailure = "eager"
    clone_outputs: bool = True
    stream: torch.cuda.Stream | None = None
    pool: PoolHandle | None = None
    backend: GraphBackend | None = None
    generators: Sequence[torch.Generator] = ()
    # What a recording must put back (`snapshot.Restorable`), which `GraphSafeGradScaler`
    # is: the core so never imports the training pieces.
    scaler: Restorable | None = None
    agree_every: int = DEFAULT_AGREE_EVERY
    replay_timeout: ReplayTimeout = "group"
    on_replay_timeout: OnReplayTimeout = "abort"
    max_graphs: int = 1
    beyond_max_graphs: BeyondMaxGraphs = "evict"
    parity: ParityCheck | bool | None = None
    verify_every: int | None = DEFAULT_VERIFY_EVERY

    def check(self, api: str = "capture_step") -> None:
        """Raise `DdpGraphUsageError` for the first value that is wrong anywhere."""
        check_policies(api, self.on_failure, self.on_input_change)
        w = self.warmup_steps
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise usage_error(
                f"`{api}(warmup_steps=...)`",
                f"expected an int >= 1, got {w!r}",
                "leave it out for the default (11 for a fresh DDP model); the last warm-up "
                "step checks the step for host synchronisations",
            )
        if not isinstance(self.clone_outputs, bool):
            raise usage_error(
                f"`{api}(clone_outputs=...)`",
                f"expected True or False, got {self.clone_outputs!r}",
                "leave it out for False",
            )
        if self.stream is not None and not isinstance(self.stream, torch.cuda.Stream):
            raise usage_error(
                f"`{api}(stream=...)`",
                f"expected a torch.cuda.Stream, got {type(self.stream).__name__}",
                "pass the stream DDP was built on, or leave it out when using `prepare_ddp`",
            )
        self._check_backend(api)
        check_family(api, self.max_graphs, self.beyond_max_graphs, self.on_input_change)
        self._check_scaler(api)
        check_watchdog_options(self.replay_timeout, self.on_replay_timeout)
        as_parity_check(self.parity)
        verify = self.verify_every
        if verify is not None and (
            isinstance(verify, bool) or not isinstance(verify, int) or verify < 1
        ):
            raise usage_error(
                f"`{api}(verify_every=...)`",
                f"expected an int >= 1 or None, got {verify!r}",
                "pass how many calls apart to check the step's Python values "
                "(100, say), or None not to check",
            )
        every = self.agree_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise usage_error(
                f"`{api}(agree_every=...)`",
                f"expected an int >= 1, got {every!r}",
                f"leave it out for the default ({DEFAULT_AGREE_EVERY})",
            )

    @property
    def parity_check(self) -> ParityCheck | None:
        return as_parity_check(self.parity)

    def _check_backend(self, api: str) -> None:
        b = self.backend
        if b is None:
            return
        if not (
            callable(getattr(b, "capture", None))
            and isinstance(getattr(b, "name", None), str)
            and hasattr(b, "executes_during_capture")
        ):
            got = repr(b) if isinstance(b, str) else f"a {type(b).__name__}"
            raise usage_error(
                f"`{api}(backend=...)`",
                "expected a graph backend object (`capture`, `name`, "
                f"`executes_during_capture`), got {got}",
                "leave it out to use CUDA graphs on a GPU, "
                "or pass `ddpgraph.PassThroughBackend()` to run on CPU",
            )

    def _check_scaler(self, api: str) -> None:
        # `torch.amp.GradScaler` is no `snapshot.Restorable`: it would read its found-inf
        # flag on the host.
        if self.scaler is not None and not isinstance(self.scaler, Restorable):
            raise DdpGraphUsageError(
                Finding(
                    Code.GRAD_SCALER_IN_CAPTURE,
                    f"expected a ddpgraph.GraphSafeGradScaler, got {type(self.scaler).__name__}, "
                    "which reads its found-inf flag on the host in `step` and `update`",
                    "use `ddpgraph.GraphSafeGradScaler()`: the same arguments and methods, "
                    "decided on the device",
                    subject=f"`{api}(scaler=...)`",
                )
            )

    def can_capture(self, device: torch.device) -> bool:
        """Whether a graph can be recorded for a model on `device` (or a stand-in is given)."""
        return self.backend is not None or can_run_graphs(device)

    def step_stream(self, model: nn.Module) -> torch.cuda.Stream | None:
        """The stream eager steps of `model` run on: the given one, or the one
        `prepare_ddp` built it on; None (the caller's stream) otherwise."""
        return self.stream or ddp_tools.built_on_stream(model)


def as_optimizers(optimizer: Optimizer | Sequence[Optimizer] | None) -> list[Optimizer]:
    """The optimizers of `capture_step(optimizer=...)` as a list; the usage error for
    anything that is not a torch optimizer."""
    if optimizer is None:
        return []
    given: list[Any] = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    items: list[Optimizer] = []
    for item in given:
        if not isinstance(item, Optimizer):
            raise usage_error(
                "`capture_step(optimizer=...)`",
                f"expected a torch.optim.Optimizer or a list of them, got {type(item).__name__}",
                "pass the optimizer(s) the step function calls `.step()` on",
            )
        items.append(item)
    return items


class CaptureSettings(TypedDict, total=False):
    """The `CaptureOptions` fields as keyword arguments of an entry point
    (`capture_step(fn, model=m, warmup_steps=3)`); see `CaptureOptions` for each.
    `agree_every=None` is the default."""

    warmup_steps: int | None
    on_failure: OnFailure
    on_input_change: OnFailure
    clone_outputs: bool
    stream: torch.cuda.Stream | None
    pool: PoolHandle | None
    backend: GraphBackend | None
    generators: Sequence[torch.Generator]
    scaler: Restorable | None
    agree_every: int | None
    replay_timeout: ReplayTimeout
    on_replay_timeout: OnReplayTimeout
    max_graphs: int
    beyond_max_graphs: BeyondMaxGraphs
    parity: ParityCheck | bool | None
    verify_every: int | None


SETTING_NAMES: tuple[str, ...] = tuple(f.name for f in fields(CaptureOptions))


def merge_settings(
    api: str,
    options: CaptureOptions | None,
    settings: Mapping[str, Any],
    names: Collection[str] = SETTING_NAMES,
) -> CaptureOptions:
    """The one `CaptureOptions` of an entry point's `options=` and its setting keywords
    (those in `names`, the settings that entry point reads).

    An unknown keyword is the `TypeError` Python raises for one; `options` given with a
    keyword whose value differs from its field is a usage error naming both, raised
    before any work."""
    unknown = [name for name in settings if name not in names]
    if unknown:
        raise TypeError(f"{api}() got an unexpected keyword argument {unknown[0]!r}")
    values = dict(settings)
    if "agree_every" in values and values["agree_every"] is None:
        values["agree_every"] = DEFAULT_AGREE_EVERY
    if "generators" in values:
        values["generators"] = tuple(values["generators"])
    if options is None:
        return CaptureOptions(**values)
    if not isinstance(options, CaptureOptions):
        raise usage_error(
            f"`{api}(options=...)`",
            f"expected a ddpgraph.CaptureOptions, got {type(options).__name__}",
            "pass `ddpgraph.CaptureOptions(...)`, or give the settings as keyword arguments",
        )
    for name, value in values.items():
        held = getattr(options, name)
        if not _same(value, held):
            raise usage_error(
                f"`{api}(options=..., {name}=...)`",
                f"{name}={value!r} conflicts with options.{name}={held!r}",
                "give each setting once: in `options` (`dataclasses.replace(options, "
                f"{name}=...)`), or as the keyword `{name}=` without `options=`",
            )
    return options


def _same(given: object, held: object) -> bool:
    if given is held:
        return True
    if isinstance(given, (tuple, list)) and isinstance(held, (tuple, list)):
        return len(given) == len(held) and all(
            _same(a, b) for a, b in zip(given, held, strict=True)
        )
    # Settings are plain values or objects compared by identity; `==` of two of a kind.
    return type(given) is type(held) and bool(given == held)


class EvalSettings(TypedDict, total=False):
    """The settings `capture_eval` reads, as keyword arguments (see `CaptureOptions`).
    `clone_outputs=None` (default) is True, as in `CaptureOptions`."""

    warmup_steps: int
    on_failure: OnFailure
    on_input_change: OnFailure
    clone_outputs: bool | None
    stream: torch.cuda.Stream | None
    pool: PoolHandle | None
    backend: GraphBackend | None


EVAL_SETTING_NAMES: tuple[str, ...] = tuple(EvalSettings.__annotations__)
