"""The `variant` fixture: a multi-process test runs once per CPU graph backend."""

from __future__ import annotations

import pytest

from variants import VARIANTS


@pytest.fixture(params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    """ "pass-through" (the stand-in backend) or "recording" (the recording backend)."""
    return str(request.param)
