"""Scenario launches shared by test modules, and other long runs tests only read, made in
the background while other tests run.

A torchrun launch costs every process a PyTorch import, so the modules that ask for the
same number of processes share one: `batched`, called when a module is imported, adds the
module's scenarios to it. A module's other long runs (a doctor run of a script, the
documents' blocks) are declared the same way with `prefetched`. Once the session has
selected its tests, tests/conftest.py puts the modules that read any of them after every
other test and calls `start`: background threads run the selected ones, in the order their
tests will ask, while the tests that need none run. One takes the launches and then helps
with the other runs, a second takes the other runs from the start, and a third the runs
that mostly wait (a hang sitting out its time limit), which would hold up the others for
no CPU. The waiting the suite does (a hang test sitting out its time limit, the watchdog's
timeouts, a process start) then leaves the CPU to them rather than to nobody. A test waits
for what it reads only; what the threads have not reached yet, the test runs itself.
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import pytest

from launcher import finish_scenarios, start_scenarios

Results = dict[str, list[dict[str, Any]]]
T = TypeVar("T")

# The script that runs the scenarios of several scripts in one launch.
TOGETHER = "together.py"


def together_name(script: str, name: str) -> str:
    """`name` of `script` as together.py reads it: "recording:x" of a.py is "recording:a.x"."""
    kind, sep, base = name.rpartition(":")
    return f"{kind}{sep}{Path(script).stem}.{base}"


class _Job:
    """Run once: by a background thread or by the first test that needs it, whichever
    claims it first; the others wait for it."""

    def __init__(self) -> None:
        self.claimed = False
        self.done = threading.Event()

    def claim(self) -> bool:
        with _lock:
            mine, self.claimed = not self.claimed, True
        return mine

    def wait_for(self, run: Callable[[], None]) -> None:
        """Until it has run: `run()` here if nobody claimed it yet."""
        if self.claim():
            run()
        self.done.wait()

    def in_background(self, tmp_path_factory: pytest.TempPathFactory) -> Callable[[], None]:
        """What a background thread calls (made in the main thread: `mktemp` is not
        for other threads)."""
        raise NotImplementedError


@dataclass(eq=False)
class _Launch(_Job):
    """The scenarios that will share one torchrun launch of `nproc` processes."""

    nproc: int
    members: list[Batch] = field(default_factory=list)
    found: Results | None = None
    proc: subprocess.Popen[str] | None = None
    error: str | None = None  # what the launch raised

    def __post_init__(self) -> None:
        super().__init__()

    def in_background(self, tmp_path_factory: pytest.TempPathFactory) -> Callable[[], None]:
        out, members = tmp_path_factory.mktemp(self.label), self.ordered(lambda b: b.selected)
        return lambda: self.run(out, members)

    def ordered(self, chosen: Callable[[Batch], bool]) -> list[Batch]:
        """The members `chosen` keeps, in the order they were added, those asking to run
        `last` after the others."""
        return sorted((b for b in self.members if chosen(b)), key=lambda b: b.last)

    @property
    def label(self) -> str:
        return f"together_{self.nproc}proc_"

    def run(self, out: Path, members: list[Batch]) -> None:
        """The launch, in whichever thread claimed it; its results, or none if it raised."""
        names = [together_name(b.script, n) for b in members for n in b.names]
        try:
            self.proc = start_scenarios(TOGETHER, names, out, nproc=self.nproc)
            self.found = finish_scenarios(
                self.proc, out, names, self.nproc, sum(b.timeout for b in members)
            )
        except Exception as err:
            self.error = f"{type(err).__name__}: {err}"
        finally:
            self.done.set()


_launches: dict[int, _Launch] = {}
_batches: list[Batch] = []
_order: list[_Job] = []  # the selected jobs, in the order their tests will ask
_lock = threading.Lock()
_threads: list[threading.Thread] = []
_session_tmp: list[pytest.TempPathFactory] = []  # the session's, once `start` has run


@dataclass(eq=False)
class Batch:
    """One test module's scenarios in a launch shared with other modules (`batched`)."""

    launch: _Launch
    script: str
    names: list[str]
    timeout: float
    last: bool = False  # run after the other members of the launch
    # False once the session's selection (`-k`, a node id) left no test of its module.
    selected: bool = True

    def results(self, tmp_path_factory: pytest.TempPathFactory) -> Results:
        """{name: [rank0, rank1, ...]} for this module's names, once its launch has run:
        the scenarios of every selected module, in the order the modules were imported
        (those asking to run `last` after the others)."""
        launch = self.launch
        launch.wait_for(
            lambda: launch.run(
                tmp_path_factory.mktemp(launch.label),
                launch.ordered(lambda b: b.selected or b is self),
            )
        )
        why = f"raised {launch.error}" if launch.error else "left this module out"
        missing = [{"error": f"the shared launch {why} (its log: torchrun.log in {launch.label}*)"}]
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
    last: bool = False,
) -> Batch:
    """`run_scenarios(script, names, ...)`, run later in one launch with the scenarios of
    every other module that asks for the same `nproc` (a script whose scenarios need a
    shorter process-group timeout says so itself: `harness.with_group_timeout`); `last`:
    after the scenarios of the modules that do not ask for it, so that what they leave in
    the processes reaches none of those.

    Call it when the module is imported: pytest imports every test module before it runs
    any test, so the launch holds all of them. Its time limit is the sum of the members'
    (`timeout` each, as for `run_scenarios`)."""
    launch = _launches.get(nproc)
    if launch is None or launch.claimed:
        launch = _launches[nproc] = _Launch(nproc)
    batch = Batch(launch, script, list(names), timeout, last)
    launch.members.append(batch)
    _batches.append(batch)
    return batch


class Prefetched(_Job, Generic[T]):
    """A call whose result a test reads (`prefetched`, `prefetched_in`); `waits`: it spends
    most of its time waiting (for a time limit, say), not computing."""

    def __init__(
        self, call: Callable[[Path | None], T], folder: str | None = None, *, waits: bool = False
    ) -> None:
        super().__init__()
        self._call = call
        self._folder = folder
        self.waits = waits
        self._value: T | None = None
        self._error: BaseException | None = None

    def _run(self, where: Path | None) -> None:
        try:
            self._value = self._call(where)
        except BaseException as err:  # raised again in the test that reads it
            self._error = err
        finally:
            self.done.set()

    def in_background(self, tmp_path_factory: pytest.TempPathFactory) -> Callable[[], None]:
        where = tmp_path_factory.mktemp(self._folder) if self._folder else None
        return lambda: self._run(where)

    def result(self) -> T:
        # Run by the test: its folder is a new one of the session's (`start` keeps the
        # factory: a test module's top level has none), or outside a session an ordinary
        # temporary one.
        self.wait_for(lambda: self._run(_new_folder(self._folder) if self._folder else None))
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def _new_folder(name: str) -> Path:
    if _session_tmp:
        return _session_tmp[0].mktemp(name)
    return Path(tempfile.mkdtemp(prefix=name))


def prefetched(call: Callable[[], T], *, waits: bool = False) -> Prefetched[T]:
    """`call()`, made once in the background when the session starts, if every test of
    the module that holds it (at its top level, alone or as the values of a dict) is
    selected, or else by the first test that reads it. `.result()` waits for it and
    returns it, or raises what it raised. For long runs of processes a test only reads,
    such as a doctor run of a script. `waits=True` for a call that mostly waits (a run that
    sits out a time limit): it runs beside the others rather than in their line."""
    return Prefetched(lambda _: call(), waits=waits)


def prefetched_in(folder: str, call: Callable[[Path], T], *, waits: bool = False) -> Prefetched[T]:
    """`prefetched`, for a call that writes its files in a new folder of the session's
    temporary ones, named after `folder`: `call(path)`."""

    def run(where: Path | None) -> T:
        assert where is not None  # every run of a call with a folder is given one
        return call(where)

    return Prefetched(run, folder, waits=waits)


def _held(module: Any) -> list[Batch | Prefetched[Any]]:
    """The batches and prefetched calls a module holds at its top level, alone or as the
    values of a dict."""
    return [
        item
        for value in vars(module).values()
        for item in (value.values() if isinstance(value, dict) else [value])
        if isinstance(item, (Batch, Prefetched))
    ]


def reads_background(module: Any) -> bool:
    return module is not None and bool(_held(module))


def plan(items: list[Any]) -> tuple[list[Batch], list[_Job]]:
    """The batches the session's launches hold, and what the background runs, in order:
    the launches of modules with a selected test, the prefetched calls of modules whose
    tests are all selected (a test runs what it reads itself); `items` are the selected
    tests, in the order they will run."""
    chosen: dict[int, tuple[Any, set[str]]] = {}
    for item in items:
        if (module := getattr(item, "module", None)) is not None:
            names = chosen.setdefault(id(module), (module, set()))[1]
            names.add(getattr(item, "originalname", item.name))
    held: list[Batch | Prefetched[Any]] = []
    for module, names in chosen.values():
        whole = {name for name in vars(module) if name.startswith("test_")} <= names
        held += [i for i in _held(module) if isinstance(i, Batch) or whole]
    jobs = [item.launch if isinstance(item, Batch) else item for item in held]
    return [b for b in held if isinstance(b, Batch)], list(dict.fromkeys(jobs))


def select(items: list[pytest.Item]) -> None:
    """Keep `plan(items)`: what the launches hold and what `start` runs."""
    batches, _order[:] = plan(items)
    for batch in _batches:
        batch.selected = batch in batches


def start(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Run the selected jobs in background threads: the launches one after another, then
    the other runs as the second thread has not yet claimed them; the other runs one after
    another from the start; the runs that mostly wait in a third. A launch keeps its
    processes busy, while a call (a doctor run) mostly waits for processes to start, so a
    launch and a call side by side fill the CPU that either alone leaves; two launches or
    two calls at once would only share it. Once the launches are done, the calls left are
    what ends the session: two threads take them."""
    _session_tmp[:] = [tmp_path_factory]
    if _threads or not _order:
        return
    runs = {id(job): job.in_background(tmp_path_factory) for job in _order}
    for lane, jobs in lanes(_order).items():
        if jobs:
            thread = threading.Thread(
                target=_run_all,
                args=([(job, runs[id(job)]) for job in jobs],),
                name=f"background-{lane}",
                daemon=True,
            )
            _threads.append(thread)
            thread.start()


def lanes(jobs: list[_Job]) -> dict[str, list[_Job]]:
    """Which jobs each background thread goes through, in order (`start`): a job that
    two threads list runs in whichever claims it first."""
    calls = [j for j in jobs if isinstance(j, Prefetched) and not j.waits]
    return {
        "launches": [j for j in jobs if isinstance(j, _Launch)] + calls,
        "calls": calls,
        "waits": [j for j in jobs if isinstance(j, Prefetched) and j.waits],
    }


def _run_all(jobs: list[tuple[_Job, Callable[[], None]]]) -> None:
    for job, run in jobs:
        if job.claim():
            run()


def stop() -> None:
    """At the session's end: a launch still running (its tests were interrupted) goes."""
    for job in _order:
        if isinstance(job, _Launch) and job.proc is not None and job.proc.poll() is None:
            job.proc.kill()
