"""Settings of installed libraries known to avoid a host synchronisation inside them.

When a step synchronises inside a library the user does not edit, the useful fix is a
setting of that library, if one is known. The evidence is the live objects on the stack
at the moment of the synchronisation (a module's configuration), not the text of any
file: a setting is named only when a module running at that moment has it.

Known today: transformers models built with `attn_implementation="eager"` synchronise
with the host while building their attention masks; PyTorch's scaled-dot-product
attention (`"sdpa"`) does not (measured on an H200 with a Llama, transformers 5.17).
transformers' mixture-of-experts layers route tokens with the `experts_implementation`
of their config: `"eager"` loops over the experts that received tokens (`nonzero`), and
`"grouped_mm"` calls `torch.nn.functional.grouped_mm`, whose CUDA kernel falls back to
a loop over host-read offsets unless both operands are bf16 (PyTorch 2.10's
`_grouped_mm`); `"batched_mm"` gathers each token's experts and multiplies in fixed
shapes, at the memory of a copy of those weights per token.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import FrameType

import torch

from .code_origin import is_installed_library, package_of


def _transformers_of(module: torch.nn.Module) -> bool:
    try:
        source = inspect.getfile(type(module))
    except (TypeError, OSError):
        return False
    return is_installed_library(source) and package_of(source) == "transformers"


def _transformers_eager_attention(module: torch.nn.Module) -> str | None:
    config = getattr(module, "config", None)
    if getattr(config, "_attn_implementation", None) != "eager" or not _transformers_of(module):
        return None
    return (
        f'`{type(module).__name__}` was built with `attn_implementation="eager"`; build it '
        'with `attn_implementation="sdpa"` (in its config, or `from_config(config, '
        'attn_implementation="sdpa")`), whose attention does not wait for the GPU'
    )


def _transformers_expert_routing(module: torch.nn.Module) -> str | None:
    # transformers' experts layers keep the model's config and an expert-parallel flag.
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    # The experts layer itself, by what it holds: the flag (transformers 5.2x) or the
    # expert count every version's experts layer keeps.
    experts = hasattr(module, "_is_expert_parallel") or hasattr(module, "num_experts")
    if implementation not in ("eager", "grouped_mm") or not experts:
        return None
    if not _transformers_of(module):
        return None
    if implementation == "eager":
        return (
            f'`{type(module).__name__}` routes tokens with `experts_implementation="eager"`, a '
            "loop over "
            "the experts that received tokens; build the model with "
            '`experts_implementation="grouped_mm"` '
            "(transformers' default), which routes in fixed shapes"
        )
    return (
        f'`{type(module).__name__}` routes tokens with `experts_implementation="grouped_mm"`, '
        "whose CUDA "
        "kernel reads the group offsets on the host unless the activations and the expert weights "
        "are both bf16: train the model in bf16 (`model.to(torch.bfloat16)`), or build it with "
        '`experts_implementation="batched_mm"` (fixed shapes, with memory for each token\'s '
        "copy of its experts' weights)"
    )


_RULES: tuple[Callable[[torch.nn.Module], str | None], ...] = (_transformers_eager_attention,)
# Rules about the part of a model that synchronised: the innermost module they fit is
# named, before any rule about the model as a whole.
_PART_RULES: tuple[Callable[[torch.nn.Module], str | None], ...] = (_transformers_expert_routing,)


def known_setting(frame: FrameType | None) -> str | None:
    """The fix a known library setting offers for a synchronisation made in `frame` (the
    innermost live frame), from the modules whose methods are running there; the
    outermost such module is named, the model the user built rather than its parts,
    unless a rule about the part that synchronised (`_PART_RULES`) fits a module first."""
    found = None
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_varnames[:1] == ("self",) else None
        if isinstance(owner, torch.nn.Module):
            part = next((hint for rule in _PART_RULES if (hint := rule(owner)) is not None), None)
            if part is not None:
                return part
            found = next((hint for rule in _RULES if (hint := rule(owner)) is not None), found)
        frame = frame.f_back
    return found
