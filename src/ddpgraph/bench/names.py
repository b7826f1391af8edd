"""The names `ddpgraph bench` knows before any worker starts, without PyTorch: its built-in
models and presets (`KNOWN_MODELS`, with what the checks of `--seq-lens` read of them),
what a `--model` entry is (`ModelInfo`), and its built-in strategies, in the registry's
order (`BUILT_IN_STRATEGIES`).

The models themselves are built in the workers (`workloads`, `presets`), and the
strategies registered there (`strategies`); tests check that both agree with the names
here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import DdpGraphUsageError, usage_error

if TYPE_CHECKING:
    from .workloads import ModelSpec


@dataclass(frozen=True)
class ModelInfo:
    """A `--model` entry as the launching process knows it: for a built-in name or a
    preset, from `KNOWN_MODELS`; for MODULE:FACTORY, from the factory's workload, which
    `resolved` keeps (resolving it imports the user's module, and torch with it)."""

    spec: str  # the entry as given (a known model's name)
    name: str  # the workload's name, which the results use
    unit: str = "samples"  # what one sample holds: "tokens", "images", "samples"
    per_sample: int = 1  # tokens per sequence for sequence models
    package: str | None = None  # the library that builds a preset
    longest: int | None = None  # a preset built again for `--seq-lens`: its most positions
    resolved: ModelSpec | None = None


def _known(
    name: str,
    unit: str = "samples",
    per_sample: int = 1,
    package: str | None = None,
    longest: int | None = None,
) -> ModelInfo:
    return ModelInfo(name, name, unit, per_sample, package, longest)


# Built-in models first, then presets, in the order the help and the errors list them.
KNOWN_MODELS: dict[str, ModelInfo] = {
    m.name: m
    for m in (
        _known("gpt", "tokens", 128),
        _known("mlp"),
        _known("resnet18", "images"),
        _known("hf-gpt2", "tokens", 256, package="transformers", longest=1024),
        _known("hf-llama", "tokens", 256, package="transformers", longest=2048),
        _known("timm-vit", "images", package="timm"),
        _known("tv-resnet50", "images", package="torchvision"),
        _known("hf-bert", "tokens", 128, package="transformers"),
        _known("hf-moe", "tokens", 256, package="transformers"),
        _known("hf-moe-bf16", "tokens", 256, package="transformers"),
        _known("tv-syncbn", "images", package="torchvision"),
        _known("hf-gpt2-ckpt", "tokens", 256, package="transformers"),
    )
}
# Each preset and the library that builds it.
PRESET_PACKAGES = {name: m.package for name, m in KNOWN_MODELS.items() if m.package is not None}

# The registry's built-in rows, in the order the tables list them (`strategies`).
BUILT_IN_STRATEGIES = tuple(
    ["eager", "torch-compile", "reduce-overhead", "recipe", "whole", "compile", "partial"]
)


def known_model(spec: str) -> ModelInfo | None:
    """The built-in model or preset `spec` names; None for MODULE:FACTORY; a usage error
    for anything else."""
    text = spec.strip()
    if text in KNOWN_MODELS:
        return KNOWN_MODELS[text]
    if ":" not in text:
        raise usage_error(
            "`--model`",
            f"expected one of {', '.join(KNOWN_MODELS)} or MODULE:FACTORY, got {spec!r}",
            "use a built-in name, or point at your own factory, e.g. "
            "`--model my_models:make_workload`",
        )
    module_name, _, attr = text.rpartition(":")
    if not module_name or not attr:
        raise usage_error(
            "`--model`",
            f"expected MODULE:FACTORY with both parts, got {spec!r}",
            "write it as `package.module:function` or `path/to/file.py:function`",
        )
    return None


def preset_unavailable(name: str, package: str, why: str) -> DdpGraphUsageError:
    """The usage error for preset `name`, whose `package` is absent or fails to import."""
    return usage_error(
        f"`--model {name}`",
        f"expected the `{package}` package, which builds this preset, to import; "
        f"it did not ({why})",
        f"install it (`pip install {package}`) beside this torch, or leave {name} out of --model",
    )


def check_strategy_names(names: Sequence[str], known: Sequence[str]) -> None:
    """Refuse a `--strategies` name that is not among `known`."""
    unknown = [n for n in names if n not in known]
    if unknown:
        raise usage_error(
            "`--strategies`",
            f"expected names from {', '.join(known)}, got {', '.join(map(repr, unknown))}",
            "run `ddpgraph bench --list-strategies` to see them with what each does",
        )
