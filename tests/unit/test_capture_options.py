"""`capture_step`'s keywords are spelled out four times: the implementation, its three
typing overloads (one per `compile=` return type) and `CaptureOptions`, which everything
inside passes. They must name the same settings with the same defaults."""

from __future__ import annotations

import inspect
from dataclasses import fields
from typing import get_overloads

from ddpgraph.capture import capture_step
from ddpgraph.options import CaptureOptions

# Arguments of `capture_step` that are not capture settings.
NOT_OPTIONS = {"fn", "model", "optimizer", "compile"}


def _keywords(fn: object) -> dict[str, inspect.Parameter]:
    return {name: p for name, p in inspect.signature(fn).parameters.items()}  # type: ignore[arg-type]


def test_every_overload_takes_exactly_the_implementations_keywords() -> None:
    implementation = _keywords(capture_step)
    overloads = get_overloads(capture_step)
    assert len(overloads) == 3
    for overload in overloads:
        assert list(_keywords(overload)) == list(implementation)


def test_the_options_object_holds_every_setting_with_the_same_default() -> None:
    implementation = {k: p for k, p in _keywords(capture_step).items() if k not in NOT_OPTIONS}
    options = {f.name for f in fields(CaptureOptions)} - {"extra"}
    assert options == set(implementation)
    defaults = CaptureOptions()
    for name, parameter in implementation.items():
        if name == "agree_every":
            continue  # None in the signature means "the default", which the object holds
        assert getattr(defaults, name) == parameter.default, name


def test_kwargs_round_trips_through_capture_steps_keywords() -> None:
    given = CaptureOptions(warmup_steps=5, max_graphs=3, extra={"parity": True})
    kwargs = given.kwargs(clone_outputs=True)
    assert set(kwargs) <= set(_keywords(capture_step))
    assert kwargs["warmup_steps"] == 5 and kwargs["max_graphs"] == 3
    assert kwargs["parity"] is True and kwargs["clone_outputs"] is True
