"""What `ddpgraph bench` knows by name before any worker starts, without PyTorch
(`bench/names.py`), is what its workers build and register: each built-in model and
preset's name, unit and sequence length, each preset's library and which presets are
built again for `--seq-lens`, and the built-in strategies in the registry's order.
"""

from __future__ import annotations

import pytest

from ddpgraph.app.models import BUILTIN_WORKLOADS
from ddpgraph.bench import registered
from ddpgraph.bench.names import BUILT_IN_STRATEGIES, KNOWN_MODELS, PRESET_PACKAGES
from ddpgraph.bench.presets import PRESETS
from ddpgraph.bench.varlen_data import sized
from ddpgraph.bench.workloads import resolve_model


@pytest.mark.parametrize("name", list(KNOWN_MODELS))
def test_a_known_model_is_what_its_workload_is(name: str) -> None:
    known = KNOWN_MODELS[name]
    if known.package is not None:
        pytest.importorskip(known.package)
    workload = resolve_model(name).workload
    assert (workload.name, workload.unit, workload.per_sample) == (
        known.name,
        known.unit,
        known.per_sample,
    )


def test_the_known_names_are_the_built_in_models_then_the_presets() -> None:
    assert list(KNOWN_MODELS) == [*BUILTIN_WORKLOADS, *PRESETS]
    assert {name: p.package for name, p in PRESETS.items()} == PRESET_PACKAGES


@pytest.mark.parametrize(
    "name", [n for n, m in KNOWN_MODELS.items() if m.unit == "tokens" and n != "gpt"]
)
def test_the_presets_with_a_longest_length_are_built_again_for_it(name: str) -> None:
    known = KNOWN_MODELS[name]
    pytest.importorskip(known.package or "")
    model = resolve_model(name)
    rebuilt = sized(model, known.per_sample // 2, cpu_sized=True)
    assert (rebuilt is not model) is (known.longest is not None)
    if known.longest is not None:
        assert rebuilt.workload.per_sample == known.per_sample // 2


def test_the_built_in_strategies_in_the_registrys_order() -> None:
    names = [s.name for s in registered()]
    assert names[: len(BUILT_IN_STRATEGIES)] == list(BUILT_IN_STRATEGIES)
