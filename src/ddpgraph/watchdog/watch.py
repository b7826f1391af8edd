"""A replayed step never waits forever: each replay's GPU work is watched from a thread.

c10d's watchdog times out the collectives it launches. A collective replayed from a CUDA
graph is launched by the graph, not by c10d, and is not tracked (pytorch#102542), so a
graphed job whose peer never arrives would wait silently, forever.

After each replay the training thread records a CUDA event on the replay stream and
appends it to a queue: no host synchronisation, no lock, a few microseconds. A daemon
thread polls only the oldest pending event with `query()`, which never waits and never
touches the capture stream. It may query while the training thread records another graph
(a new input signature of a family, a re-capture): ddpgraph records in CUDA's
"thread_local" capture mode (`capture_mode`), where another thread's query of an event
recorded before the capture cannot invalidate it. A replay is late when it has not
finished `timeout_s` after it could start (the later of its launch and the previous
replay's end, since the host may run ahead of the GPU by many replays). Then, on the rank
that sees it:

- "report": the finding (code REPLAY_TIMED_OUT, naming the step, the replay, how long it
  waited, and what the other ranks last published to the job's store) goes to the log and
  stderr, and training goes on waiting.
- "abort" (the default, as c10d does for eager collectives): the report, then
  1. a checkpoint that the training thread is writing with `torch.save` at that moment is
     waited for (up to `checkpoint_wait_s`): it finishes intact if it needs nothing from
     the late replay; if it does, it can never finish, and the process ends *without*
     aborting, leaving an incomplete file that `torch.load` rejects rather than a complete
     one with values an aborted replay computed;
  2. `torch.save` refuses from then on in this process, for the same reason;
  3. the process group's communicators are aborted (on a daemon thread: an abort can
     block), so the replay's collectives return and a training thread blocked on the GPU
     gets control back; its next call of the step raises `DdpGraphError`;
  4. `exit_grace_s` later, if the process is still alive, it ends with `os._exit(EXIT_CODE)`.
  torchrun ends the other ranks when one fails, so the job fails together.

The watchdog is the one place where a rank acts alone, on purpose: its only action is to
end the job, which every rank then does.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch

from ..agreement.peers import NoBoard, PeerBoard
from ..ddp.distributed import close_at_exit
from ..ddp.streams import can_run_graphs
from ..errors import DdpGraphError, usage_error
from ..findings import Code, Finding
from . import groups
from .checkpoint_guard import refuse_torch_save, thread_in_torch_save

log = logging.getLogger("ddpgraph")

Policy = Literal["abort", "report"]
ReplayTimeout = float | Literal["group"] | None
EXIT_CODE = 86  # the exit status of a process the watchdog ended
EXIT_GRACE_S = 30.0
# Board indices name the same step on every rank: steps of a DDP model count up; steps
# without a process group (group None), which another rank may not have (an EMA model),
# count down, so that they never shift the others.
_indices, _solo_indices = itertools.count(), itertools.count(-1, -1)
# The current stream's CUDA handle, without building a Stream object (CUDA builds only).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class ReplayEvent(Protocol):
    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...


class FinishedEvent:
    """A replay without a GPU (the stand-in backend) has finished when `replay` returns."""

    def record(self, stream: Any = None) -> None:
        return

    def query(self) -> bool:
        return True


def event_factory_for(device: torch.device) -> Callable[[], ReplayEvent]:
    if can_run_graphs(device):
        return torch.cuda.Event
    return FinishedEvent


# A pending replay: (replay number, launch time, its event). A plain tuple: the training
# thread makes one per replay, and a tuple is the cheapest record Python has.
_Pending = tuple[int, float, ReplayEvent]


class ReplayWatchdog:
    """Watches the replays of one captured step.

    `after_replay` (training thread, after each replay) and `check` (training thread,
    before each call; raises once the watchdog aborted) and `close`. The keyword-only
    arguments after `device` replace the clock, the events and the actions, for tests.
    """

    def __init__(
        self,
        timeout_s: float | None,
        policy: Policy = "abort",
        step_name: str = "step",
        group: Any = None,
        *,
        device: torch.device | None = None,
        clock: Callable[[], float] = time.monotonic,
        event_factory: Callable[[], ReplayEvent] | None = None,
        board: PeerBoard | NoBoard | None = None,
        abort: Callable[[Any], str] = groups.abort,
        end_process: Callable[[int], Any] = os._exit,
        refuse_saves: Callable[[Finding], None] = refuse_torch_save,
        in_checkpoint: Callable[[int | None], bool] = thread_in_torch_save,
        sleep: Callable[[float], Any] = time.sleep,
        exit_grace_s: float = EXIT_GRACE_S,
        checkpoint_wait_s: float | None = None,
        poll_s: float | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.policy = policy
        self.step_name = step_name
        self.group = group
        self.rank = groups.global_rank()
        device = device or torch.device("cpu")
        self._device = device
        self._cuda = can_run_graphs(device)
        self._stream: Any = None  # the stream of the last replay (`_current_stream`)
        self._clock = clock
        self._new_event = event_factory or event_factory_for(device)
        wait = timeout_s or 1.0
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(0.01, wait / 50))
        self.board = board if board is not None else _board_for(group, self.rank, wait)
        self._abort = abort
        self._end_process = end_process
        self._refuse_saves = refuse_saves
        self._in_checkpoint = in_checkpoint
        self._sleep = sleep
        self.exit_grace_s = exit_grace_s
        self.checkpoint_wait_s = checkpoint_wait_s if checkpoint_wait_s is not None else wait
        self.replays = 0
        self.finished = 0
        self.calls: int | None = (
            None  # the step's calls, set by the step, published with the replays
        )
        self.failure: Finding | None = None
        self.reported: list[Finding] = []
        self.aborted_with = ""
        self._pending: deque[_Pending] = deque()
        self._spare: deque[ReplayEvent] = deque()
        self._head_since = float("-inf")
        self._late: int | None = None
        self._trainer: int | None = None
        self._thread: threading.Thread | None = None
        self._aborter: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------ training thread
    def after_replay(self, stream: Any = None) -> None:
        """Record an event after the replay just launched; `stream` defaults to the
        current stream of the step's device, which is where the graph was launched."""
        if self.timeout_s is None:
            return
        self.replays += 1
        event = self._spare.pop() if self._spare else self._new_event()
        if stream is None and self._cuda:
            stream = self._current_stream()
        event.record(stream)
        self._pending.append((self.replays, self._clock(), event))
        if self._thread is None:
            self._trainer = threading.get_ident()
            self._thread = threading.Thread(
                target=_watch,
                args=(weakref.ref(self), self._stop, self.poll_s),
                name=f"ddpgraph-watchdog-{self.step_name}",
                daemon=True,
            )
            self._thread.start()

    def _current_stream(self) -> Any:
        # `torch.cuda.current_stream` builds a Stream object on every call, a good part
        # of this method's cost: the one of the last replay serves while the device's
        # current stream (a raw handle, cheap to read where the build exposes it) is the same.
        raw = _raw_stream(self._device.index or 0) if _raw_stream is not None else None
        cached = self._stream
        if raw is None or cached is None or cached.cuda_stream != raw:
            cached = self._stream = torch.cuda.current_stream(self._device)
        return cached

    def check(self) -> None:
        """Raise the timeout's finding once the watchdog aborted the process group."""
        if self.failure is not None:
            raise DdpGraphError(self.failure)

    def close(self) -> None:
        """Stop watching. After an abort the exit deadline stays: the process must end."""
        self._stop.set()
        if self.calls is not None and self.failure is None:  # for a peer waiting for this rank
            self.board.publish(self.replays, self.finished, calls=self.calls)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and self.failure is None:
            thread.join(timeout=max(1.0, 4 * self.poll_s))

    # ------------------------------------------------------------ watchdog thread
    def poll(self, now: float) -> bool:
        """Retire finished replays, publish progress, report a late one. True when the
        policy says to act (the caller then runs `act`)."""
        self._retire(now)
        self.board.maybe_publish(self.replays, self.finished, now, self.calls)
        if not self._pending or self.timeout_s is None:
            return False
        replay, launched, _ = self._pending[0]
        waited = now - max(launched, self._head_since)
        if waited < self.timeout_s or self._late == replay:
            return False
        self._late = replay
        finding = self._late_finding(replay, waited)
        self.board.publish(self.replays, self.finished, timed_out=replay)
        self.reported.append(finding)
        _say(f"ddpgraph watchdog: {finding.format()}")
        if self.policy == "abort":
            self.failure = finding
            return True
        return False

    def _retire(self, now: float) -> None:
        while self._pending:
            replay, _, event = self._pending[0]
            if not event.query():
                break
            self._pending.popleft()
            self._spare.append(event)
            self.finished = replay
            self._head_since = now
            if replay == self._late:  # only under "report": the late replay did finish
                _say(f"ddpgraph watchdog: replay {replay} of `{self.step_name}` finished after all")

    def act(self) -> None:
        """The "abort" policy, after the report (see the module docstring)."""
        assert self.failure is not None
        give_up = self._clock() + self.checkpoint_wait_s
        while self._in_checkpoint(self._trainer):
            if self._clock() >= give_up:
                self._end(
                    "the training thread is still in `torch.save` after "
                    f"{self.checkpoint_wait_s:g} s, waiting for the late replay; "
                    "ending without abort, so that the checkpoint stays incomplete "
                    "(torch.load rejects it) rather than holding aborted values"
                )
                return
            self._sleep(self.poll_s)
        self._refuse_saves(self.failure)
        aborter = threading.Thread(target=self._abort_group, name="ddpgraph-abort", daemon=True)
        aborter.start()
        self._aborter = aborter  # published once started: another thread may join it
        deadline = self._clock() + self.exit_grace_s
        while self._clock() < deadline:
            self._sleep(self.poll_s)
        self._end(f"the process did not end within {self.exit_grace_s:g} s of the abort")

    def _abort_group(self) -> None:
        try:
            self.aborted_with = self._abort(self.group) or "nothing to abort"
            _say(f"ddpgraph watchdog: aborted the process group ({self.aborted_with})")
        except Exception as exc:
            _say(f"ddpgraph watchdog: aborting the process group failed: {exc!r}")

    def _end(self, why: str) -> None:
        _say(f"ddpgraph watchdog: ending the process with exit status {EXIT_CODE}: {why}")
        for handler in [*logging.getLogger().handlers, *log.handlers]:
            handler.flush()
        self._end_process(EXIT_CODE)

    def _late_finding(self, replay: int, waited: float) -> Finding:
        return Finding(
            Code.REPLAY_TIMED_OUT,
            f"replay {replay} has not finished after {waited:.1f} s (replay_timeout="
            f"{self.timeout_s:g} s; this rank launched {self.replays} replays, {self.finished} "
            "finished); "
            f"{self.board.describe_others()}",
            subject=f"`{self.step_name}`",
            ranks=(self.rank,),
        )


def _watch(ref: weakref.ref[ReplayWatchdog], stop: threading.Event, poll_s: float) -> None:
    """The thread's loop. It holds its watchdog weakly between polls, so that a step the
    user dropped without `close()` takes its watchdog, and this thread, with it."""
    while not stop.is_set():
        watchdog = ref()
        if watchdog is None:
            return
        if watchdog.poll(watchdog._clock()):
            watchdog.act()
            return
        del watchdog
        stop.wait(poll_s)


def _say(text: str) -> None:
    """To the log and to stderr: the process may end right after, and a hung job's log
    handlers are often not configured."""
    log.error("%s", text)
    print(text, file=sys.stderr, flush=True)


def _board_for(group: Any, rank: int, timeout_s: float) -> PeerBoard | NoBoard:
    store = groups.job_store()
    if store is None:
        return NoBoard()
    publish_s = min(5.0, max(0.05, timeout_s / 4))
    return PeerBoard(
        store,
        next(_indices if group is not None else _solo_indices),
        rank,
        groups.ranks_of(group),
        publish_s,
    )


def check_options(replay_timeout: object, on_replay_timeout: object) -> None:
    """Refuse a `replay_timeout` / `on_replay_timeout` value before any work starts."""
    number = isinstance(replay_timeout, (int, float)) and not isinstance(replay_timeout, bool)
    group = isinstance(replay_timeout, str) and replay_timeout == "group"
    if not (replay_timeout is None or group or number):
        raise usage_error(
            "`capture_step(replay_timeout=...)`",
            f"expected seconds, 'group' or None, got {replay_timeout!r}",
            "pass a number of seconds, 'group' for the process group's timeout (the "
            "default), or None to not watch replays",
        )
    if number and not (math.isfinite(float(replay_timeout)) and float(replay_timeout) > 0):  # type: ignore[arg-type]
        raise usage_error(
            "`capture_step(replay_timeout=...)`",
            f"expected a positive number of seconds, got {replay_timeout!r}",
            "pass the longest a replay may take, in seconds, or None to not watch replays",
        )
    if on_replay_timeout not in ("abort", "report"):
        raise usage_error(
            "`capture_step(on_replay_timeout=...)`",
            f"expected 'abort' or 'report', got {on_replay_timeout!r}",
            "use 'abort' to fail the job together (the default) or 'report' to only log",
        )


def watch_replays(
    replay_timeout: ReplayTimeout,
    on_replay_timeout: Policy,
    *,
    step_name: str,
    group: Any,
    device: torch.device,
    close: Callable[[], None],
) -> ReplayWatchdog:
    """The watchdog `capture_step` builds: options checked, timeout resolved ("group": the
    process group's), and the step's bound `close` registered to run at interpreter exit."""
    check_options(replay_timeout, on_replay_timeout)
    close_at_exit(close)
    timeout = (
        None
        if replay_timeout is None
        else groups.timeout_s(group)
        if replay_timeout == "group"
        else float(replay_timeout)
    )
    return ReplayWatchdog(timeout, on_replay_timeout, step_name, group, device=device)
