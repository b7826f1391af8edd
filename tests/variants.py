"""The two CPU graph backends the multi-process suites run with, in one launch each.

A scenario name `recording:NAME` runs NAME with the recording backend (see
tests/scenarios/harness.py); the plain name runs it with the stand-in. The `variant`
fixture (tests/dist/conftest.py) parametrizes a test over both.
"""

from __future__ import annotations

from collections.abc import Sequence

VARIANTS = ("pass-through", "recording")


def both_backends(names: Sequence[str], recording_only: Sequence[str] = ()) -> list[str]:
    """Every scenario under both backends, and `recording_only` under the recording one."""
    return [*names, *(f"recording:{n}" for n in [*names, *recording_only])]


def key(name: str, variant: str) -> str:
    """The result name of scenario `name` run under `variant`."""
    return name if variant == "pass-through" else f"{variant}:{name}"
