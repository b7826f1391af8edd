"""Which models the benchmark trains: built-in names, or a user's `module:factory`.

The factory contract. `--model MODULE:FACTORY` names a callable that takes no
arguments; MODULE is an importable module (`my_project.bench_models`) or a path to a
Python file (`path/to/models.py`). The factory returns either

* a `ddpgraph.app.models.Workload`: `build()` makes a fresh model, `make_batch(batch_size,
  generator, device)` returns `(inputs, targets)` tensors, `loss(outputs, targets)`
  returns the scalar loss; or
* a tuple `(model, loss, make_batch)` with the same `loss` and `make_batch`; the factory
  is then called again for each strategy, so each gets a fresh model.

Either way every model is built right after `torch.manual_seed(0)`, so all strategies
start from the same weights. Mistakes are reported before any worker starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ..app.models import BUILTIN_WORKLOADS, CPU_GPT_CONFIG, Workload, gpt_workload, mlp_workload
from ..errors import DdpGraphUsageError, usage_error
from .names import known_model
from .presets import preset_workload

_CONTRACT = (
    "the factory takes no arguments and returns a `ddpgraph.app.models.Workload`, or a tuple "
    "`(model, loss, make_batch)` with `loss(outputs, targets) -> Tensor` and "
    "`make_batch(batch_size, generator, device) -> (inputs, targets)`"
)


@dataclass(frozen=True)
class ModelSpec:
    """A `--model` entry: the text the user gave and the workload it names."""

    spec: str
    workload: Workload

    @property
    def name(self) -> str:
        return self.workload.name


def resolve_model(spec: str) -> ModelSpec:
    """Turn one `--model` entry into a workload, checking the factory contract."""
    text = spec.strip()
    if known_model(spec) is not None:
        make = BUILTIN_WORKLOADS.get(text)
        return ModelSpec(text, make() if make is not None else preset_workload(text))
    module_name, _, attr = text.rpartition(":")
    factory = _load_factory(module_name, attr, text)
    return ModelSpec(text, _as_workload(factory, text))


def cpu_default_models() -> list[ModelSpec]:
    """The models benchmarked without CUDA when `--model` is not given."""
    return [
        ModelSpec("gpt", gpt_workload(CPU_GPT_CONFIG)),
        ModelSpec("mlp", mlp_workload(dim=64, hidden=256, depth=2)),
    ]


def _load_factory(module_name: str, attr: str, spec: str) -> Callable[[], Any]:
    module = _import(module_name, spec)
    if not hasattr(module, attr):
        raise usage_error(
            f"`--model {spec}`",
            f"module `{module_name}` has no attribute `{attr}`",
            f"define `def {attr}():` in {module.__file__ or module_name}; {_CONTRACT}",
        )
    factory = getattr(module, attr)
    if not callable(factory):
        raise usage_error(
            f"`--model {spec}`",
            f"expected `{attr}` to be a callable factory, got {type(factory).__name__}",
            _CONTRACT,
        )
    return factory  # type: ignore[no-any-return]


def _import(module_name: str, spec: str) -> ModuleType:
    is_file = module_name.endswith(".py") or os.sep in module_name
    try:
        if not is_file:
            # torchrun's workers run with the launching directory on sys.path.
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            return importlib.import_module(module_name)
        path = os.path.abspath(module_name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no file {path}")
        name = "_ddpgraph_bench_" + os.path.splitext(os.path.basename(path))[0]
        loader_spec = importlib.util.spec_from_file_location(name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ImportError(f"cannot load {path} as a Python module")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        loader_spec.loader.exec_module(module)
        return module
    except Exception as err:
        raise usage_error(
            f"`--model {spec}`",
            f"could not import `{module_name}`: {type(err).__name__}: {err}",
            "run from the directory that holds the module (or add it to PYTHONPATH), "
            "or give the path of a .py file",
        ) from err


def _call(factory: Callable[[], Any], spec: str) -> Any:
    try:
        return factory()
    except DdpGraphUsageError:
        raise
    except Exception as err:
        raise usage_error(
            f"`--model {spec}`",
            f"calling the factory raised {type(err).__name__}: {err}",
            _CONTRACT,
        ) from err


def _as_workload(factory: Callable[[], Any], spec: str) -> Workload:
    torch.manual_seed(0)
    made = _call(factory, spec)
    if isinstance(made, Workload):
        workload = made
    else:
        model, loss, make_batch = _unpack(made, spec)
        del model  # each strategy gets its own, from a new call

        def build() -> nn.Module:
            return _unpack(_call(factory, spec), spec)[0]

        workload = Workload(spec, build, make_batch, loss)
    _check_workload(workload, spec)
    return workload


def _unpack(made: Any, spec: str) -> tuple[nn.Module, Callable[..., Any], Callable[..., Any]]:
    if not isinstance(made, (tuple, list)) or len(made) != 3:
        got = (
            f"{type(made).__name__} of {len(made)}"
            if isinstance(made, (tuple, list))
            else type(made).__name__
        )
        raise usage_error(
            f"`--model {spec}`",
            f"expected the factory to return a Workload or (model, loss, make_batch), got {got}",
            _CONTRACT,
        )
    model, loss, make_batch = made
    if not isinstance(model, nn.Module):
        raise usage_error(
            f"`--model {spec}`",
            f"expected the first item to be a torch.nn.Module, got {type(model).__name__}",
            _CONTRACT,
        )
    for label, fn in (("loss", loss), ("make_batch", make_batch)):
        if not callable(fn):
            raise usage_error(
                f"`--model {spec}`",
                f"expected `{label}` to be callable, got {type(fn).__name__}",
                _CONTRACT,
            )
    return model, loss, make_batch


def _check_workload(workload: Workload, spec: str) -> None:
    """Make one tiny batch on the CPU: a wrong `make_batch` fails here, not in 2 workers."""
    try:
        batch = workload.make_batch(2, torch.Generator().manual_seed(0), torch.device("cpu"))
    except Exception as err:
        raise usage_error(
            f"`--model {spec}`",
            f"`make_batch(2, generator, torch.device('cpu'))` raised {type(err).__name__}: {err}",
            _CONTRACT,
        ) from err
    if not (
        isinstance(batch, (tuple, list))
        and len(batch) == 2
        and all(isinstance(t, torch.Tensor) for t in batch)
    ):
        raise usage_error(
            f"`--model {spec}`",
            f"expected `make_batch` to return (inputs, targets) tensors, got {_describe(batch)}",
            _CONTRACT,
        )


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__
