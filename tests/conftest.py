"""Fixtures shared by every test directory.

`process_group` gives a test a one-process gloo group, made once per session (DDP
construction needs one); the autouse fixture destroys any other group a test leaves
initialised, and the session ends with no group at all.

mypy starts in the background before collection where its test may be selected, and is
stopped once the tests are selected if it was not (tests/code_checks.py says why). Once
they are, a hook puts the modules that read a shared torchrun launch after all the others
and leaves out of those launches the scenarios of modules with no test selected; the
first test starts the launches in the background (tests/shared_launches.py says why).
"""

from __future__ import annotations

import compileall
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import code_checks
import collector
import ddpgraph
import shared_launches
from ddpgraph.ddp.distributed import DistInfo
from launcher import REPO, free_port

# The group `process_group` made; any other initialised group was left by a test.
_owned: list[object] = []


def _world() -> object:
    return dist.group.WORLD


@pytest.fixture
def process_group() -> DistInfo:
    """A one-process gloo default group (rank 0 of 1), shared by the tests that ask."""
    if not dist.is_initialized():
        # init_distributed fills in torchrun's variables when they are missing; they are
        # only read while the group is made, and must not reach subprocesses that later
        # tests start (a child would think it is a torchrun worker).
        with pytest.MonkeyPatch.context() as env:
            for name, value in {
                "RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()),
            }.items():
                env.setenv(name, value)
            ddpgraph.init_distributed(force_cpu=True, timeout_s=60)
        _owned[:] = [_world()]
    assert dist.get_world_size() == 1
    return DistInfo(dist.get_rank(), 1, 0, torch.device("cpu"), "gloo")


@pytest.fixture(autouse=True)
def _no_leaked_process_group() -> Iterator[None]:
    yield
    if dist.is_initialized() and (not _owned or _world() is not _owned[0]):
        dist.destroy_process_group()


@pytest.fixture(scope="session", autouse=True)
def _destroy_process_group_at_exit() -> Iterator[None]:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    _owned.clear()


def pytest_configure(config: pytest.Config) -> None:
    # Some eighty processes of the suite import ddpgraph and the scenarios from source, and
    # where no bytecode is written (PYTHONDONTWRITEBYTECODE, a fresh checkout) each compiled
    # them again: 0.2 CPU-seconds a process. Compiled once here, in under a second.
    for folder in ("src", "tests"):
        compileall.compile_dir(REPO / folder, quiet=1)
    if code_checks.may_run(config.args, config.option.markexpr or ""):
        code_checks.start_mypy()


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` deselected what they leave out
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A stable sort: modules stay whole and in order, those reading background runs last.
    items.sort(key=lambda item: shared_launches.reads_background(getattr(item, "module", None)))
    shared_launches.select(items)
    # Every test module is imported by now: what they and the libraries made stays out of
    # the collections the tests' own garbage brings (tests/collector.py).
    collector.settle()
    collector.tune()
    if any(
        item.path == code_checks.TEST_FILE and item.name == "test_mypy_is_clean" for item in items
    ):
        code_checks.start_mypy()
    else:
        code_checks.stop()  # started before collection, for a test not selected


@pytest.fixture(scope="session", autouse=True)
def _shared_launches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    shared_launches.start(tmp_path_factory)
    yield


def pytest_sessionfinish(session: pytest.Session) -> None:
    code_checks.stop()
    shared_launches.stop()
