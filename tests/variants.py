"""The two CPU graph backends the multi-process suites run with, in one launch each.

A scenario name `recording:NAME` runs NAME with the recording backend (see
tests/scenarios/harness.py); the plain name runs it with the stand-in. The `variant`
fixture (tests/dist/conftest.py) parametrizes a test over both.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

# DDPGRAPH_CPU_VARIANTS=pass-through runs the suites with the stand-in alone: what they
# cost without the recording backend (docs/cpu-backend.md has both times).
VARIANTS = tuple(os.environ.get("DDPGRAPH_CPU_VARIANTS", "pass-through,recording").split(","))


def both_backends(names: Sequence[str], recording_only: Sequence[str] = ()) -> list[str]:
    """Every scenario under both backends, and `recording_only` under the recording one."""
    recorded = (
        [f"recording:{n}" for n in [*names, *recording_only]] if "recording" in VARIANTS else []
    )
    return [*names, *recorded] if "pass-through" in VARIANTS else recorded


def key(name: str, variant: str) -> str:
    """The result name of scenario `name` run under `variant`."""
    return name if variant == "pass-through" else f"{variant}:{name}"
