"""What the arguments of `ddpgraph bench` choose (`Choice`), every one checked, in the order
the first bad one is reported, without PyTorch: the launching process runs these checks
before it starts torchrun, and each worker runs them again before it builds the models
(`worker.plan_of`).

Two entries import more than this, because what they name must be loaded to be checked:
a `--model MODULE:FACTORY` (the user's module, which imports torch, is imported and its
factory called: `workloads.resolve_model`), and a `--plot` file (matplotlib, which writes
it, says which formats it can).
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..app import arguments
from ..ddp.process import cuda_available
from ..errors import usage_error
from .names import (
    BUILT_IN_STRATEGIES,
    KNOWN_MODELS,
    ModelInfo,
    check_strategy_names,
    known_model,
    preset_unavailable,
)
from .settings import MIN_WARMUP, RECIPE_WARMUP_ITERATIONS, Settings
from .stats import default_window
from .varlen_plan import MIN_WARMUP as VARLEN_MIN_WARMUP
from .varlen_plan import VarLen, check_sized, parse_varlen

DEFAULT_MODELS = "gpt,resnet18"
# Per-GPU batch sizes benchmarked when `--batch-sizes` does not name the model: one
# where launch overhead dominates, one where the GPU has more work per step.
DEFAULT_BATCH_SIZES: dict[str, list[int]] = {
    "gpt": [8, 32],
    "resnet18": [32, 128],
    "mlp": [64, 256],
}
FALLBACK_BATCH_SIZES = [8, 32]
# Without CUDA: the GPU-sized models take many minutes per strategy on CPU processes.
CPU_DEFAULT_BATCH_SIZES: dict[str, list[int]] = {"gpt": [4, 16], "mlp": [16, 64]}
CPU_DEFAULTS_NOTE = (
    "No CUDA here: CPU-sized default models (gpt: 2 layers, width 64, 32 tokens; mlp: 2 "
    "layers, width 256) and batch sizes gpt 4,16 and mlp 16,64. `--model` and `--batch-sizes` "
    "choose others. On CPU the `whole` rows are emulated (recorded once and replayed without "
    "Python by ddpgraph's recording backend): the times check the setup, not the speed, and "
    "their × eager is marked `emulated`."
)
# The variable-length case's per-GPU batch: launch-bound, where graphs matter.
VARLEN_BATCH, VARLEN_CPU_BATCH = 8, 4
VARLEN_CPU_NOTE = (
    "No CUDA here: the variable-length case runs its eager rows and its capture_step rows "
    "emulated on CPU (no CUDA graphs); reduce-overhead and compile rows need CUDA. The times "
    "check the setup, not the speed."
)


@dataclass(frozen=True)
class Choice:
    """What the arguments choose: the models (CPU-sized defaults where `cpu_sized`),
    their batch sizes, the strategies' names (None: every available one), the settings,
    and the variable-length case, if any."""

    models: list[ModelInfo]
    batch_sizes: dict[str, list[int]]
    strategies: list[str] | None
    settings: Settings
    amp: str
    cpu_sized: bool  # no CUDA and no --model: the CPU-sized models
    note: str | None = None  # said before the run: why these models
    varlen: VarLen | None = None


def choose(args: argparse.Namespace) -> Choice:
    """Check every argument of `ddpgraph bench`, and say what they choose."""
    arguments.at_least("--steps", args.steps, 1)
    arguments.at_least(
        "--warmup",
        args.warmup,
        MIN_WARMUP,
        f"captured strategies run {RECIPE_WARMUP_ITERATIONS} eager DDP iterations and "
        "capture on the next call; timing starts after that",
    )
    arguments.at_least("--profile-steps", args.profile_steps, 0)
    arguments.at_least("--loader-workers", args.loader_workers, 0)
    arguments.process_count(args.nproc, args.cpu)
    arguments.output_file("--json", args.json_path, "bench.json")
    arguments.output_file("--plot", args.plot_path, "bench.png", _plot_formats(args.plot_path))
    on_cuda = cuda_available() and not args.cpu
    cpu_sized = args.model is None and not on_cuda
    names = strategy_names(args.strategies)
    varlen = parse_varlen(args.seq_lens, args.buckets, names)
    if varlen is not None:
        return _varlen_choice(args, varlen, on_cuda)
    if cpu_sized:
        models = [KNOWN_MODELS[name] for name in CPU_DEFAULT_BATCH_SIZES]
    else:
        models = resolve_models([m for m in (args.model or DEFAULT_MODELS).split(",") if m.strip()])
    if not models:
        raise usage_error(
            "`--model`",
            "expected at least one model, got none",
            f"for example `--model {DEFAULT_MODELS}`",
        )
    defaults = CPU_DEFAULT_BATCH_SIZES if cpu_sized else DEFAULT_BATCH_SIZES
    batch_sizes = parse_batch_sizes(args.batch_sizes, models, defaults)
    _check_strategies(names, models)
    return Choice(
        models,
        batch_sizes,
        names,
        settings_from(args),
        args.amp,
        cpu_sized,
        note=CPU_DEFAULTS_NOTE if cpu_sized else None,
    )


def _varlen_choice(args: argparse.Namespace, varlen: VarLen, on_cuda: bool) -> Choice:
    """The variable-length case: sequence models only (gpt by default), batch 8 (4 on CPU),
    the device feed only, and a warm-up long enough for every bucket's capture."""
    models = resolve_models([m for m in (args.model or "gpt").split(",") if m.strip()])
    for model in models:
        check_sized(model, varlen.high)
    batch = VARLEN_BATCH if on_cuda else VARLEN_CPU_BATCH
    sizes = parse_batch_sizes(args.batch_sizes, models, {m.name: [batch] for m in models})
    settings = settings_from(args)
    # Device feed only: the DataLoader feed would start every capture again on pinned inputs.
    settings = replace(settings, dataloader=False, warmup=max(settings.warmup, VARLEN_MIN_WARMUP))
    return Choice(
        models,
        sizes,
        ["eager", "reduce-overhead"],
        settings,
        args.amp,
        cpu_sized=args.model is None and not on_cuda,
        note=None if on_cuda else VARLEN_CPU_NOTE,
        varlen=varlen,
    )


def resolve_models(specs: list[str]) -> list[ModelInfo]:
    """The `--model` entries, each checked: a built-in name or a preset (whose library
    must be installed) from `names.KNOWN_MODELS`, a MODULE:FACTORY resolved; each model
    once."""
    models = [_model(s) for s in specs]
    names = [m.name for m in models]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise usage_error(
            "`--model`",
            f"expected each model once, got {', '.join(repeated)} more than once",
            "list each model once; give a factory's Workload a distinct `name`",
        )
    return models


def _model(spec: str) -> ModelInfo:
    known = known_model(spec)
    if known is None:
        # Imported here: the factory's module imports torch, which the other entries,
        # checked without it, never need (`workloads` imports torch too).
        from .workloads import resolve_model

        resolved = resolve_model(spec)
        workload = resolved.workload
        return ModelInfo(
            resolved.spec, resolved.name, workload.unit, workload.per_sample, resolved=resolved
        )
    if known.package is not None and not _installed(known.package):
        why = f"ModuleNotFoundError: No module named {known.package!r}"
        raise preset_unavailable(known.name, known.package, why)
    return known


def _installed(package: str) -> bool:
    """Whether `package` can be found, without importing it (a preset's library imports
    torch; the workers import it, and report a build that fails to)."""
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # loaded already, without a spec
        return True


def parse_batch_sizes(
    entries: list[str] | None,
    models: Sequence[ModelInfo],
    defaults: dict[str, list[int]] = DEFAULT_BATCH_SIZES,
) -> dict[str, list[int]]:
    """`--batch-sizes 8,32` (every model) or `gpt=8,32 resnet18=32,128` (per model)."""
    chosen: dict[str, list[int]] = {
        m.name: defaults.get(m.name, FALLBACK_BATCH_SIZES) for m in models
    }
    lookup = {m.name: m.name for m in models} | {m.spec: m.name for m in models}
    for entry in entries or []:
        target, sep, sizes = entry.rpartition("=")
        values = _positive_ints(sizes, entry)
        if not sep:
            chosen = {name: values for name in chosen}
        elif target in lookup:
            chosen[lookup[target]] = values
        else:
            raise usage_error(
                "`--batch-sizes`",
                f"{entry!r} names model {target!r}, which is not among --model "
                f"({', '.join(m.name for m in models)})",
                "write `NAME=8,32` with a NAME from --model, or `8,32` for every model",
            )
    return chosen


def _positive_ints(text: str, entry: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise usage_error(
            "`--batch-sizes`",
            f"expected positive integers like `8,32` or `gpt=8,32`, got {entry!r}",
            "give per-GPU batch sizes separated by commas",
        )
    return sorted(dict.fromkeys(values))


def strategy_names(text: str | None) -> list[str] | None:
    """The names given to `--strategies`; None for every available one."""
    if text in (None, "all"):
        return None
    return [s.strip() for s in text.split(",") if s.strip()]


def _check_strategies(names: list[str] | None, models: Sequence[ModelInfo]) -> None:
    """Refuse a `--strategies` name that is no strategy's. A user's module, imported to
    resolve its factory, may have registered strategies of its own: then the registry
    decides, as in the workers."""
    if names is None:
        return
    if not any(m.resolved is not None for m in models):
        check_strategy_names(names, BUILT_IN_STRATEGIES)
        return
    # Imported here: the registry imports torch, loaded already by the user's module.
    from . import strategies  # noqa: F401  (registers the built-in strategies)
    from .registry import select

    select(names)


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(
        steps=args.steps,
        warmup=args.warmup,
        window=default_window(args.steps),
        profile_steps=args.profile_steps,
        dataloader=args.data_loader,
        loader_workers=args.loader_workers,
    )


def _plot_formats(path: str | None) -> tuple[str, ...]:
    """The formats the plot can be written as, asked of matplotlib only when there is a
    plot to write."""
    if path is None:
        return ()
    # Imported here: matplotlib takes a while to import, and draws only for `--plot`.
    from .plot import plot_formats

    return plot_formats()
