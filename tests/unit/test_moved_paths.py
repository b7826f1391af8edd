"""Module paths that moved keep working for one release: importing one warns with the new
path, and its names are the new modules' objects. Names of the package root stay as they
are, without a warning."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Iterator

import pytest

import ddpgraph

# old path -> (new path, the names it must give, each from the module it lives in now)
MOVED: dict[str, tuple[str, dict[str, str]]] = {
    "ddpgraph.amp": ("ddpgraph.training.scaler", {"GraphSafeGradScaler": "ddpgraph.training.scaler", "ScalerStats": "ddpgraph.training.scaler_state"}),
    "ddpgraph.monitor": ("ddpgraph.training.monitor", {"NonFiniteMonitor": "ddpgraph.training.monitor"}),
    "ddpgraph.checkpoint": ("ddpgraph.training.checkpoint", {"training_state": "ddpgraph.training.checkpoint"}),
    "ddpgraph.evaluation": ("ddpgraph.strategies.evaluation", {"capture_eval": "ddpgraph.strategies.evaluation"}),
    "ddpgraph.partial": (
        "ddpgraph.strategies.partial",
        {
            "graph_submodules": "ddpgraph.strategies.partial",
            "GraphedForward": "ddpgraph.strategies.partial_graphed",
            "AutocastState": "ddpgraph.strategies.partial_record",
            "relative_difference": "ddpgraph.strategies.partial_check",
        },
    ),
    "ddpgraph.cli": ("ddpgraph.app.cli", {"main": "ddpgraph.app.cli", "build_parser": "ddpgraph.app.cli"}),
    "ddpgraph.demo": ("ddpgraph.app.demo", {"add_arguments": "ddpgraph.app.demo"}),
    "ddpgraph.models": ("ddpgraph.app.models", {"TinyGPT": "ddpgraph.app.models", "Workload": "ddpgraph.app.models"}),
    "ddpgraph.launch": ("ddpgraph.app.launch", {"torchrun_command": "ddpgraph.app.launch"}),
    "ddpgraph.arguments": ("ddpgraph.app.arguments", {}),
    "ddpgraph.report": ("ddpgraph.app.console", {"console": "ddpgraph.app.console"}),
}


@pytest.fixture
def fresh_import() -> Iterator[None]:
    """Each old path imported as for the first time, and the process left as it was."""
    saved_modules = {name: sys.modules.pop(name) for name in list(sys.modules) if name in MOVED}
    saved_attrs = {name: vars(ddpgraph).pop(name.rsplit(".", 1)[1]) for name in MOVED if name.rsplit(".", 1)[1] in vars(ddpgraph)}
    yield
    for name in MOVED:
        sys.modules.pop(name, None)
        vars(ddpgraph).pop(name.rsplit(".", 1)[1], None)
    sys.modules.update(saved_modules)
    for name, value in saved_attrs.items():
        setattr(ddpgraph, name.rsplit(".", 1)[1], value)


@pytest.mark.usefixtures("fresh_import")
@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_with_the_new_one_and_gives_the_same_objects(old: str) -> None:
    new, names = MOVED[old]
    with pytest.warns(DeprecationWarning, match=rf"`{old}` moved to `{new}`") as caught:
        module = __import__(old, fromlist=["__all__"])  # as an `import` statement does
    # The warning points at the line that imports the old path, not into ddpgraph.
    assert [w.filename for w in caught if issubclass(w.category, DeprecationWarning)] == [__file__]
    for name, home in names.items():
        assert getattr(module, name) is getattr(importlib.import_module(home), name), name
    target = importlib.import_module(new)
    assert set(module.__all__) <= {n for m in {new, *names.values()} for n in dir(importlib.import_module(m))}
    assert target is not module


def test_accumulate_stays_the_root_function_when_its_old_module_path_is_imported() -> None:
    home = importlib.import_module("ddpgraph.training.accumulate")
    function = ddpgraph.accumulate
    assert function is home.accumulate
    with pytest.warns(DeprecationWarning, match=r"`ddpgraph.accumulate` moved to `ddpgraph.training.accumulate`"):
        from ddpgraph.accumulate import split_batch
    __import__("ddpgraph.accumulate")  # what `import ddpgraph.accumulate` runs

    assert split_batch is home.split_batch
    assert ddpgraph.accumulate is function


@pytest.mark.parametrize(
    ("name", "home"),
    [("make_train_step", "ddpgraph.app.reference_step"), ("StepOptions", "ddpgraph.app.reference_step"), ("synchronize", "ddpgraph.ddp.streams")],
)
def test_the_reference_step_names_still_resolve_from_ddpgraph_training(name: str, home: str) -> None:
    training = importlib.import_module("ddpgraph.training")
    with pytest.warns(DeprecationWarning, match=rf"`ddpgraph.training.{name}` moved to `{home}.{name}`"):
        value = getattr(training, name)
    assert value is getattr(importlib.import_module(home), name)


def test_the_package_root_names_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in ddpgraph.__all__:
            getattr(ddpgraph, name)
        training = importlib.import_module("ddpgraph.training")
        for name in training.__all__:
            getattr(training, name)


def test_the_command_and_python_m_ddpgraph_run_from_the_new_place() -> None:
    import re
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    entry = re.search(r'^\[project\.scripts\]\nddpgraph = "([\w.]+):(\w+)"', pyproject, re.M)
    assert entry is not None
    module, function = entry.groups()
    assert module == "ddpgraph.app.cli"
    assert getattr(importlib.import_module(module), function) is importlib.import_module("ddpgraph.app.cli").main
    main = Path(ddpgraph.__file__).with_name("__main__.py").read_text()
    assert "from .app.cli import main" in main


# Names `ddpgraph.inputs.replay` held before the give-up policy had a module of its own:
# the old path stays (it keeps the replay and the eager call) and re-exports them unchanged.
REPLAY_NAMES = {
    "OnFailure": "ddpgraph.cycle.fallback",
    "UnservedCalls": "ddpgraph.cycle.fallback",
    "check_policies": "ddpgraph.cycle.fallback",
    "fall_back": "ddpgraph.cycle.fallback",
}


@pytest.mark.parametrize(("name", "home"), sorted(REPLAY_NAMES.items()))
def test_names_that_left_replay_still_import_from_it(name: str, home: str) -> None:
    replay = importlib.import_module("ddpgraph.inputs.replay")
    assert getattr(replay, name) is getattr(importlib.import_module(home), name)


def test_the_doctor_watches_the_give_up_where_it_lives_now() -> None:
    from ddpgraph.doctor import instrument

    assert "ddpgraph.cycle.fallback" in instrument._DDPGRAPH_MODULES
    fallback = importlib.import_module("ddpgraph.cycle.fallback")
    assert fallback.fall_back.__module__ == "ddpgraph.cycle.fallback"
    assert fallback.UnservedCalls.__module__ == "ddpgraph.cycle.fallback"
