"""Scenario launches shared by test modules, run in the background while other tests run.

A torchrun launch costs every process a PyTorch import, so the modules that ask for the
same number of processes and process-group timeout share one: `batched`, called when a
module is imported, adds the module's scenarios to it. Once the session has selected its
tests, tests/conftest.py puts the modules that read a launch after every other test and
calls `start`: one background thread runs the selected launches one after another, in the
order their tests will ask, while the tests that need none run. The waiting the suite
does (a hang test sitting out its time limit, the watchdog's timeouts, a process start)
then leaves the CPU to the launches rather than to nobody. A test that needs a launch's
results waits for that launch only; one the thread has not reached it runs itself.
"""

from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from launcher import finish_scenarios, start_scenarios

Results = dict[str, list[dict[str, Any]]]

# The script that runs the scenarios of several scripts in one launch.
TOGETHER = "together.py"


def together_name(script: str, name: str) -> str:
    """`name` of `script` as together.py reads it: "recording:x" of a.py is "recording:a.x"."""
    kind, sep, base = name.rpartition(":")
    return f"{kind}{sep}{Path(script).stem}.{base}"


@dataclass(eq=False)
class _Launch:
    """The scenarios that will share one torchrun launch of `nproc` processes."""

    nproc: int
    group_timeout_s: float | None
    members: list[Batch] = field(default_factory=list)
    found: Results | None = None
    claimed: bool = False  # by the background thread or by a test, whichever came first
    done: threading.Event = field(default_factory=threading.Event)
    proc: subprocess.Popen[str] | None = None
    error: str | None = None  # what the launch raised

    @property
    def label(self) -> str:
        timeout = "" if self.group_timeout_s is None else f"_group_timeout{self.group_timeout_s:g}s"
        return f"together_{self.nproc}proc{timeout}_"

    def run(self, out: Path, members: list[Batch]) -> None:
        """The launch, in whichever thread claimed it; its results, or none if it raised."""
        names = [together_name(b.script, n) for b in members for n in b.names]
        self.found = {}  # a launch that raised is not run again by the next module
        try:
            self.proc = start_scenarios(
                TOGETHER, names, out, nproc=self.nproc, group_timeout_s=self.group_timeout_s
            )
            self.found = finish_scenarios(
                self.proc, out, names, self.nproc, sum(b.timeout for b in members)
            )
        except Exception as err:
            self.error = f"{type(err).__name__}: {err}"
        finally:
            self.done.set()


_launches: dict[tuple[int, float | None], _Launch] = {}
_batches: list[Batch] = []
_order: list[_Launch] = []  # the selected launches, in the order their tests will ask
_lock = threading.Lock()
_thread: threading.Thread | None = None


@dataclass(eq=False)
class Batch:
    """One test module's scenarios in a launch shared with other modules (`batched`)."""

    launch: _Launch
    script: str
    names: list[str]
    timeout: float
    # False once the session's selection (`-k`, a node id) left no test of its module.
    selected: bool = True

    def results(self, tmp_path_factory: pytest.TempPathFactory) -> Results:
        """{name: [rank0, rank1, ...]} for this module's names, once its launch has run:
        the scenarios of every selected module, in the order the modules were imported."""
        launch = self.launch
        with _lock:
            mine = not launch.claimed
            launch.claimed = True
        if mine:
            members = [b for b in launch.members if b.selected or b is self]
            launch.run(tmp_path_factory.mktemp(launch.label), members)
        launch.done.wait()
        why = (
            f"the shared launch raised {launch.error}"
            if launch.error
            else ("the shared launch left this module out")
        )
        missing = [{"error": f"{why} (its log: torchrun.log in {launch.label}*)"}]
        found = launch.found or {}
        return {
            n: found.get(together_name(self.script, n), missing * launch.nproc) for n in self.names
        }


def batched(
    script: str,
    names: list[str],
    *,
    nproc: int,
    timeout: float,
    group_timeout_s: float | None = None,
) -> Batch:
    """`run_scenarios(script, names, ...)`, run later in one launch with the scenarios of
    every other module that asks for the same `nproc` and `group_timeout_s`.

    Call it when the module is imported: pytest imports every test module before it runs
    any test, so the launch holds all of them. Its time limit is the sum of the members'
    (`timeout` each, as for `run_scenarios`)."""
    key = (nproc, group_timeout_s)
    launch = _launches.get(key)
    if launch is None or launch.claimed:
        launch = _launches[key] = _Launch(nproc, group_timeout_s)
    batch = Batch(launch, script, list(names), timeout)
    launch.members.append(batch)
    _batches.append(batch)
    return batch


def _held(module: Any) -> list[Batch]:
    """The batches a module holds at its top level, alone or as the values of a dict."""
    return [
        item
        for value in vars(module).values()
        for item in (value.values() if isinstance(value, dict) else [value])
        if isinstance(item, Batch)
    ]


def reads_a_launch(module: Any) -> bool:
    return module is not None and bool(_held(module))


def select_batches(modules: list[Any]) -> None:
    """Leave out of the shared launches the batches of modules none of whose tests the
    session runs; `modules` are the selected tests' modules, in the order they will run,
    which is the order `start` runs their launches in."""
    held = [b for module in modules for b in _held(module)]
    for batch in _batches:
        batch.selected = batch in held
    _order[:] = list(dict.fromkeys(b.launch for b in held))


def start(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Run the selected launches one after another in a background thread."""
    global _thread
    if _thread is not None or not _order:
        return
    todo = [(launch, tmp_path_factory.mktemp(launch.label)) for launch in _order]

    def run_all() -> None:
        for launch, out in todo:
            with _lock:
                mine = not launch.claimed
                launch.claimed = True
            if mine:
                launch.run(out, [b for b in launch.members if b.selected])

    _thread = threading.Thread(target=run_all, name="scenario-launches", daemon=True)
    _thread.start()


def stop() -> None:
    """At the session's end: a launch still running (its tests were interrupted) goes."""
    for launch in _order:
        if launch.proc is not None and launch.proc.poll() is None:
            launch.proc.kill()
