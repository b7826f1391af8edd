"""What the other ranks last reported about their replays, without a collective.

A rank whose replay waits for a peer cannot ask that peer anything through the process
group: its collective is the one that is stuck. The job's store (torchrun's TCPStore)
group is a separate connection. Each rank's watchdog thread writes there how many replays it
launched and how many finished, and how many calls of the step it made, at most every
`publish_s` and only when they changed, so the training thread never talks to the store;
the rank that times out reads the others' entries. The rank that launched the fewest
replays is the one that stopped calling the step: the ranks waiting for it have finished
exactly as many as it has.

The same entries name the rank when a collective of the step fails on the CPU (gloo
times it out, or the peer's process is gone): `stopped_finding`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed

from ..errors import DdpGraphError
from ..findings import Code, Finding, format_ranks

log = logging.getLogger("ddpgraph")
PREFIX = "ddpgraph/replays"


@dataclass
class PeerBoard:
    """One entry per rank under `ddpgraph/replays/<watchdog index>/<rank>`.

    `index` tells apart the watchdogs of several captured steps in one process; steps
    are created in the same order on every rank, so the same index names the same
    step everywhere.
    """

    store: Any
    index: int
    rank: int
    ranks: list[int]
    publish_s: float
    wall_clock: Callable[[], float] = time.time
    _published: tuple[int, int, int | None] | None = field(default=None, init=False)
    _last_publish: float = field(default=float("-inf"), init=False)

    def key(self, rank: int) -> str:
        return f"{PREFIX}/{self.index}/{rank}"

    def maybe_publish(
        self, launched: int, finished: int, now: float, calls: int | None = None
    ) -> None:
        """Publish the counts if they changed and `publish_s` passed since the last write."""
        if (
            launched,
            finished,
            calls,
        ) == self._published or now - self._last_publish < self.publish_s:
            return
        self._last_publish = now
        self.publish(launched, finished, calls=calls)

    def publish(
        self, launched: int, finished: int, timed_out: int | None = None, calls: int | None = None
    ) -> None:
        entry = {
            "launched": launched,
            "finished": finished,
            "time": self.wall_clock(),
            "timed_out": timed_out,
            "calls": calls,
        }
        try:
            self.store.set(self.key(self.rank), json.dumps(entry))
            self._published = (launched, finished, calls)
        except Exception as exc:  # the store is best effort: never let it stop the watch
            log.debug("watchdog could not write to the store: %s", exc)

    def read(self, rank: int) -> dict[str, Any] | None:
        key = self.key(rank)
        try:
            if not self.store.check([key]):
                return None
            entry = json.loads(self.store.get(key))
        except Exception as exc:
            log.debug("watchdog could not read rank %d from the store: %s", rank, exc)
            return None
        return entry if isinstance(entry, dict) else None

    def describe_others(self) -> str:
        """One clause per group of ranks that reported the same counts, fewest launched
        replays first; a group's age is that of its oldest report."""
        others = [r for r in self.ranks if r != self.rank]
        if not others:
            return "no other ranks in the process group"
        now = self.wall_clock()
        groups: dict[tuple[int, int, Any, Any], list[tuple[int, float]]] = {}
        silent: list[int] = []
        for r in others:
            entry = self.read(r)
            if entry is None:
                silent.append(r)
                continue
            key = (
                int(entry.get("launched", 0)),
                int(entry.get("finished", 0)),
                entry.get("timed_out"),
                entry.get("calls"),
            )
            groups.setdefault(key, []).append((r, max(0.0, now - float(entry.get("time", now)))))
        parts = []
        for (launched, finished, timed_out, calls), members in sorted(
            groups.items(), key=lambda kv: kv[0][:2]
        ):
            ranks = [r for r, _ in members]
            ago = round(max(a for _, a in members))
            who = f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}"
            made = f"made {calls} calls and " if calls is not None else ""
            text = f"{who} {made}launched {launched} replays, {finished} finished ({ago} s ago)"
            if timed_out is not None:
                text += f" and timed out waiting for replay {timed_out}"
            parts.append(text)
        if silent:
            parts.append(
                f"rank{'s' if len(silent) > 1 else ''} {format_ranks(silent)} reported nothing"
            )
        return "; ".join(parts)


class NoBoard:
    """Without a store (no process group): nothing to publish, nothing known of peers."""

    def maybe_publish(
        self, launched: int, finished: int, now: float, calls: int | None = None
    ) -> None:
        return

    def publish(
        self, launched: int, finished: int, timed_out: int | None = None, calls: int | None = None
    ) -> None:
        return

    def describe_others(self) -> str:
        return "the other ranks' progress is unknown (no process-group store)"


# What gloo says when a peer never joined a collective, or its process is gone. NCCL's
# errors are `DistBackendError`s; a replayed NCCL collective is the watchdog's.
_GLOO_FAILURES = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer")


def collective_failed(error: BaseException) -> bool:
    """Whether `error` is a collective that could not complete for want of a peer."""
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    return isinstance(error, RuntimeError) and any(
        marker in str(error) for marker in _GLOO_FAILURES
    )


def stopped_finding(error: BaseException, waited_in: str, call: int, others: str) -> Finding:
    """RANK_STOPPED: this rank's collective on `call` failed; `others` is what the other
    ranks last published (`PeerBoard.describe_others`)."""
    text = str(error).strip()
    head = text.splitlines()[0] if text else type(error).__name__
    return Finding(
        Code.RANK_STOPPED,
        f"{waited_in} on call {call} of the step could not complete ({type(error).__name__}: "
        f"{head[:200]}); the rank with the fewest calls stopped calling the step: {others}",
        subject="`CapturedStep` call",
    )


class NamingStoppedRanks:
    """Around a collective of one call of the step (`with`, or `name(err)` in an
    `except`): an error that is a collective failed for want of a peer is raised again as
    RANK_STOPPED, naming who stopped (`others`: what the peers published); any other error
    is left alone."""

    __slots__ = ("call", "others", "waited_in")

    def __init__(self, waited_in: str, call: int, others: Callable[[], str]) -> None:
        self.waited_in, self.call, self.others = waited_in, call, others

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        if isinstance(error, RuntimeError):
            self.name(error)

    def name(self, error: RuntimeError) -> None:
        if collective_failed(error):
            raise DdpGraphError(
                stopped_finding(error, self.waited_in, self.call, self.others())
            ) from error
