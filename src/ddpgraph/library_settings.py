"""Settings of installed libraries known to avoid a host synchronisation inside them.

When a step synchronises inside a library the user does not edit, the useful fix is a
setting of that library, if one is known. The evidence is the live objects on the stack
at the moment of the synchronisation (a module's configuration), not the text of any
file: a setting is named only when a module running at that moment has it.

Known today: transformers models built with `attn_implementation="eager"` synchronise
with the host while building their attention masks; PyTorch's scaled-dot-product
attention (`"sdpa"`) does not (measured on an H200 with a Llama, transformers 5.17).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import FrameType

import torch

from .code_origin import is_installed_library, package_of


def _transformers_eager_attention(module: torch.nn.Module) -> str | None:
    config = getattr(module, "config", None)
    if getattr(config, "_attn_implementation", None) != "eager":
        return None
    try:
        source = inspect.getfile(type(module))
    except (TypeError, OSError):
        return None
    if not is_installed_library(source) or package_of(source) != "transformers":
        return None
    return (
        f"`{type(module).__name__}` was built with `attn_implementation=\"eager\"`; build it "
        "with `attn_implementation=\"sdpa\"` (in its config, or `from_config(config, "
        "attn_implementation=\"sdpa\")`), whose attention does not wait for the GPU"
    )


_RULES: tuple[Callable[[torch.nn.Module], str | None], ...] = (_transformers_eager_attention,)


def known_setting(frame: FrameType | None) -> str | None:
    """The fix a known library setting offers for a synchronisation made in `frame` (the
    innermost live frame), from the modules whose methods are running there; the
    outermost such module is named, the model the user built rather than its parts."""
    found = None
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_varnames[:1] == ("self",) else None
        if isinstance(owner, torch.nn.Module):
            found = next((hint for rule in _RULES if (hint := rule(owner)) is not None), found)
        frame = frame.f_back
    return found
