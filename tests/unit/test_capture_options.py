"""`CaptureOptions` is the one description of the capture settings: `capture_step` has
one signature, taking the settings as `options=` or as keywords of the same names
(`CaptureSettings`), and giving both only where they agree."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any, get_overloads

import pytest
from torch import nn

import ddpgraph
from ddpgraph import CaptureOptions, DdpGraphUsageError
from ddpgraph.capture import capture_step
from ddpgraph.options import DEFAULT_AGREE_EVERY, CaptureSettings, merge_settings
from ddpgraph.strategies import make_step
from ddpgraph.strategies.evaluation import capture_eval


def test_the_keywords_name_exactly_the_options_fields() -> None:
    fields = [f.name for f in dataclasses.fields(CaptureOptions)]
    assert list(CaptureSettings.__annotations__) == fields


def test_no_field_is_typed_any() -> None:
    hints = typing.get_type_hints(CaptureOptions)
    assert all(hint is not Any for hint in hints.values()), hints


def test_capture_step_has_one_parameter_list() -> None:
    implementation = list(inspect.signature(capture_step).parameters)
    assert implementation == ["fn", "model", "optimizer", "compile", "options", "settings"]
    overloads = get_overloads(capture_step)
    assert len(overloads) == 2
    assert all(list(inspect.signature(o).parameters) == implementation for o in overloads)


def test_keywords_make_the_options_with_the_same_defaults() -> None:
    assert merge_settings("capture_step", None, {}) == CaptureOptions()
    made = merge_settings(
        "capture_step", None, {"warmup_steps": 5, "agree_every": None, "generators": []}
    )
    assert made == CaptureOptions(warmup_steps=5, agree_every=DEFAULT_AGREE_EVERY, generators=())


def test_options_and_agreeing_keywords_are_one_setting() -> None:
    options = CaptureOptions(warmup_steps=5, max_graphs=3)
    assert merge_settings("capture_step", options, {"warmup_steps": 5}) is options


def test_a_keyword_that_conflicts_with_options_names_both_before_any_work() -> None:
    options = CaptureOptions(warmup_steps=5)
    model = nn.Linear(2, 2)
    with pytest.raises(DdpGraphUsageError) as info:
        capture_step(lambda x: x, model=model, options=options, warmup_steps=3)
    text = str(info.value)
    assert "`capture_step(options=..., warmup_steps=...)`" in text
    assert "warmup_steps=3 conflicts with options.warmup_steps=5" in text
    assert "dataclasses.replace(options, warmup_steps=...)" in text
    with pytest.raises(DdpGraphUsageError, match="make_step"):
        make_step(lambda x: x, model=model, options=options, on_failure="raise")


def test_an_unknown_keyword_is_a_type_error_as_before() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'warmup'"):
        capture_step(lambda x: x, model=model, warmup=3)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="unexpected keyword argument 'parity'"):
        capture_eval(lambda x: x, model=model, parity=True)  # type: ignore[call-arg]


def test_options_that_are_no_capture_options_are_a_usage_error() -> None:
    with pytest.raises(DdpGraphUsageError, match=r"expected a ddpgraph\.CaptureOptions"):
        capture_step(lambda x: x, model=nn.Linear(2, 2), options={"warmup_steps": 3})  # type: ignore[call-overload]


@pytest.mark.usefixtures("process_group")
def test_every_entry_point_takes_options() -> None:
    model = nn.Linear(2, 2)
    options = CaptureOptions(warmup_steps=2, backend=ddpgraph.PassThroughBackend())
    with capture_step(lambda x: model(x).sum(), model=model, options=options) as step:
        assert step._options == options
    with make_step(
        lambda x: model(x).sum(), model=model, strategy="eager", options=options
    ) as eager:
        assert eager.state is ddpgraph.StepState.EAGER
    evaluate = capture_eval(lambda x: model(x), model=model, options=options)
    assert evaluate._options.warmup_steps == 2 and evaluate._options.backend is options.backend
    evaluate.close()
