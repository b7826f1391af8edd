"""A host synchronisation inside a library the user does not own: the chain from the
user's line to the library's frame, and a fix that needs no edit of the library.

The "libraries" here are modules written at test time, under a folder laid out like an
installation (`.../site-packages/<package>/`), and the "user's code" one under another
root: which is which is decided by the file's location alone.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from ddpgraph import Code
from ddpgraph.probe.syncs import ProbeResult, SyncEvent, classify, host_sync_finding

LIBRARY = """
    import sys
    import traceback

    import torch
    from ddpgraph.probe.library_settings import known_setting


    def masked_mean(x):
        seen.append((traceback.extract_stack(), known_setting(sys._getframe())))
        return x.mean()


    class Attention(torch.nn.Module):
        def __init__(self, implementation):
            super().__init__()
            self.config = type("Config", (), {"_attn_implementation": implementation})()

        def forward(self, x):
            return masked_mean(x)


    class Experts(torch.nn.Module):
        def __init__(self, implementation):
            super().__init__()
            self.config = type("Config", (), {"_experts_implementation": implementation})()
            self._is_expert_parallel = False

        def forward(self, x):
            return masked_mean(x)


    class MoeModel(torch.nn.Module):
        def __init__(self, experts):
            super().__init__()
            self.config = type("Config", (), {"_attn_implementation": "eager"})()
            self.experts = Experts(experts)

        def forward(self, x):
            return self.experts(x)


    seen = []
"""

USER_MODEL = """
    from fakelib.ops import Attention


    class Net:
        def __init__(self):
            self.attention = Attention("eager")

        def __call__(self, x):
            return self.attention(x)  # the user's line
"""


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / "__init__.py").touch()
    path.write_text(textwrap.dedent(text))


@pytest.fixture
def installed(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """`fakelib` and a `transformers` stand-in installed under a site folder, and the
    user's `project/net.py` under another root."""
    site = tmp_path / "env" / "lib" / "python3" / "site-packages"
    write(site / "fakelib" / "ops.py", LIBRARY)
    write(site / "transformers" / "ops.py", LIBRARY)
    write(tmp_path / "project" / "usernet.py", USER_MODEL)
    (tmp_path / "project" / "__init__.py").unlink()
    sys.path[:0] = [str(site), str(tmp_path / "project")]
    saved = {
        k: sys.modules.pop(k)
        for k in list(sys.modules)
        if k == "transformers" or k.startswith("transformers.")
    }
    try:
        for name in ("fakelib.ops", "usernet"):
            sys.modules.pop(name, None)
        modules = {
            name: importlib.import_module(name)
            for name in ("fakelib.ops", "transformers.ops", "usernet")
        }
        yield modules
    finally:
        sys.path.remove(str(site))
        sys.path.remove(str(tmp_path / "project"))
        for name in ("fakelib", "fakelib.ops", "transformers", "transformers.ops", "usernet"):
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def test_a_sync_in_a_library_names_the_users_line_then_the_librarys(
    installed: dict[str, Any],
) -> None:
    import torch

    installed["usernet"].Net()(torch.ones(2))
    stack, setting = installed["fakelib.ops"].seen[-1]
    assert setting is None  # fakelib has no known setting
    finding = classify(stack, setting=setting)
    assert finding is not None and finding.code is Code.HOST_SYNC_IN_CAPTURE
    assert finding.location is not None and finding.location.filename.endswith("usernet.py")
    assert finding.location.source == "return self.attention(x)  # the user's line"
    assert "calls into fakelib" in finding.happened
    library_line = next(f for f in stack if f.name == "masked_mean")
    assert f"fakelib/ops.py:{library_line.lineno}, in `masked_mean`" in finding.happened
    assert "seen.append(" in finding.happened  # the library's line that waited
    assert 'strategy="partial"' in finding.hint and "no edit of fakelib" in finding.hint


def test_a_known_setting_of_transformers_is_the_fix(installed: dict[str, Any]) -> None:
    import torch

    attention = installed["transformers.ops"].Attention("eager")
    attention(torch.ones(2))
    stack, setting = installed["transformers.ops"].seen[-1]
    finding = classify(stack, setting=setting)
    assert finding is not None and 'attn_implementation="sdpa"' in finding.hint
    assert '`Attention` was built with `attn_implementation="eager"`' in finding.hint


@pytest.mark.parametrize("experts", ["eager", "grouped_mm"])
def test_expert_routing_that_waits_names_the_fixed_shape_routing(
    installed: dict[str, Any], experts: str
) -> None:
    # The experts layer that synchronised is named, not the model around it (whose
    # eager attention is another setting, and not the cause here).
    import torch

    installed["transformers.ops"].MoeModel(experts)(torch.ones(2))
    stack, setting = installed["transformers.ops"].seen[-1]
    finding = classify(stack, setting=setting)
    assert (
        finding is not None
        and f'`Experts` routes tokens with `experts_implementation="{experts}"`' in finding.hint
    )
    assert (
        'experts_implementation="grouped_mm"' if experts == "eager" else "model.to(torch.bfloat16)"
    ) in finding.hint


def test_routing_in_fixed_shapes_is_not_blamed(installed: dict[str, Any]) -> None:
    import torch

    installed["transformers.ops"].MoeModel("batched_mm")(torch.ones(2))
    _, setting = installed["transformers.ops"].seen[-1]
    assert setting is not None and "attn_implementation" in setting  # the model's own setting


def test_the_setting_is_named_only_when_the_running_module_has_it(
    installed: dict[str, Any],
) -> None:
    import torch

    installed["transformers.ops"].Attention("sdpa")(torch.ones(2))
    _, setting = installed["transformers.ops"].seen[-1]
    assert setting is None


def test_the_same_code_outside_an_installation_is_the_users(tmp_path: Path) -> None:
    # A module with the library's text, under the user's root: its own line is the place.
    write(tmp_path / "mine" / "ops.py", LIBRARY)
    sys.path.insert(0, str(tmp_path))
    try:
        sys.modules.pop("mine.ops", None)
        ops = importlib.import_module("mine.ops")
        import torch

        ops.Attention("eager")(torch.ones(2))
        stack, setting = ops.seen[-1]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("mine", None)
        sys.modules.pop("mine.ops", None)
    assert setting is None
    finding = host_sync_finding(stack)
    assert finding.location is not None and finding.location.filename.endswith("ops.py")
    assert "calls into" not in finding.happened
    assert finding.happened.startswith("`seen.append(")


def test_a_sync_in_the_users_own_code_keeps_the_short_form() -> None:
    stack = traceback.extract_stack()
    finding = host_sync_finding(stack)
    assert finding.location is not None and finding.location.filename == __file__
    assert finding.happened == "`stack = traceback.extract_stack()` waits for the GPU"


def test_the_probes_findings_carry_the_setting_capture_step_reports(
    installed: dict[str, Any],
) -> None:
    # `capture_step` builds `step.reason` from `ProbeResult.findings()`: the same chain.
    import torch

    from ddpgraph.probe.syncs import ProbeResult, SyncEvent

    installed["transformers.ops"].Attention("eager")(torch.ones(2))
    stack, setting = installed["transformers.ops"].seen[-1]
    [finding] = ProbeResult([SyncEvent(stack, setting)]).findings()
    assert finding.code is Code.HOST_SYNC_IN_CAPTURE and finding.fix == setting
    assert "calls into transformers" in finding.happened


def test_a_known_setting_is_the_fix_even_without_a_frame_of_the_users(
    installed: dict[str, Any],
) -> None:
    # Called from generated code only (a notebook cell, `python -c`): the library's own
    # frame is the place, and the setting still the fix.
    import torch

    from ddpgraph.probe.code_origin import is_installed_library

    installed["transformers.ops"].Attention("eager")(torch.ones(2))
    stack, setting = installed["transformers.ops"].seen[-1]
    generated = traceback.FrameSummary("<stdin>", 1, "<module>")
    library_only = [generated, *(f for f in stack if is_installed_library(f.filename))]
    finding = host_sync_finding(library_only, setting)
    assert finding.location is not None and finding.location.filename.endswith("ops.py")
    assert finding.fix == setting and setting is not None


def test_the_probe_leaves_a_librarys_sync_to_the_capture(installed: dict[str, Any]) -> None:
    # Libraries skip some synchronising checks while a CUDA graph is recorded
    # (transformers' mask building asks `is_cuda_stream_capturing`), so the probe step,
    # which is not recorded, cannot tell whether they break a capture: the capture judges.
    import torch

    from ddpgraph.probe.syncs import ProbeResult, SyncEvent

    installed["usernet"].Net()(torch.ones(2))
    library_stack, setting = installed["fakelib.ops"].seen[-1]
    users = traceback.extract_stack()
    probe = ProbeResult([SyncEvent(library_stack, setting), SyncEvent(users)])
    [kept] = probe.findings(defer_library=True)
    assert kept.location is not None and kept.location.filename == __file__
    [deferred] = probe.deferred()
    assert "calls into fakelib" in deferred.happened
    assert len(probe.findings()) == 2  # during or after a capture, both count


def test_a_librarys_sync_is_left_to_the_capture_when_the_step_is_ddpgraphs_own(
    installed: dict[str, Any],
) -> None:
    # `ddpgraph bench` and the integrations run a step ddpgraph wrote around a library's
    # model: no frame of the user's is on the stack, and the sync is still the library's.
    import torch

    from ddpgraph.probe.code_origin import is_installed_library, is_platform
    from ddpgraph.probe.syncs import ProbeResult, SyncEvent

    installed["usernet"].Net()(torch.ones(2))
    library_stack, setting = installed["fakelib.ops"].seen[-1]
    no_user = [
        f for f in library_stack if is_platform(f.filename) or is_installed_library(f.filename)
    ]
    assert no_user and len(no_user) < len(library_stack)
    probe = ProbeResult([SyncEvent(no_user, setting)])
    assert probe.findings(defer_library=True) == []
    [deferred] = probe.deferred()
    assert deferred.code is Code.HOST_SYNC_IN_CAPTURE


class _WaitsInBackward(torch.autograd.Function):
    """An operation whose gradient waits on the host: the stacks its backward records, as
    a Python backward shows it (its own frame innermost) and as a C++ kernel's wait shows
    it (no frame of the operation itself)."""

    stacks: ClassVar[list[list[traceback.FrameSummary]]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _WaitsInBackward.stacks.append(traceback.extract_stack())  # the user's own wait
        return grad * 2


def _backward_stack() -> list[traceback.FrameSummary]:
    x = torch.ones(2, requires_grad=True)
    _WaitsInBackward.apply(x).sum().backward()  # the user's backward line
    return _WaitsInBackward.stacks[-1][:-1]


def test_a_wait_in_the_backward_pass_is_named_by_the_librarys_forward(
    installed: dict[str, Any],
) -> None:
    # The backward pass's stack shows only `loss.backward()`: the library's last wait
    # before it (the experts' routing, not the mask before it) names operation and fix.
    installed["transformers.ops"].Attention("eager")(torch.ones(2))
    installed["transformers.ops"].MoeModel("grouped_mm")(torch.ones(2))
    (mask, mask_setting), (experts, experts_setting) = installed["transformers.ops"].seen[-2:]
    backward = _backward_stack()
    probe = ProbeResult(
        [
            SyncEvent(mask, mask_setting),
            SyncEvent(experts, experts_setting),
            SyncEvent(backward),
            SyncEvent(backward),
        ]
    )
    found = probe.findings(defer_library=True)
    assert len(found) == 1 and found[0].code is Code.HOST_SYNC_IN_CAPTURE
    assert "the backward pass of it waits for the GPU too" in found[0].happened
    assert "model.to(torch.bfloat16)" in found[0].hint
    cause = probe.library_cause()
    assert cause is not None and cause.hint == experts_setting
    # Without a library's wait, the backward's own line is the place, as before.
    alone = ProbeResult([SyncEvent(backward)]).findings(defer_library=True)
    assert len(alone) == 1 and alone[0].location is not None
    assert alone[0].location.source.endswith("# the user's backward line")
    assert ProbeResult([SyncEvent(backward)]).library_cause() is None


def test_a_wait_in_the_users_own_backward_is_named_at_its_line(
    installed: dict[str, Any],
) -> None:
    # A custom autograd Function's backward is code of the user's: its own line stands.
    installed["transformers.ops"].MoeModel("grouped_mm")(torch.ones(2))
    experts, setting = installed["transformers.ops"].seen[-1]
    _backward_stack()
    own = _WaitsInBackward.stacks[-1]
    found = ProbeResult([SyncEvent(experts, setting), SyncEvent(own)]).findings(defer_library=True)
    assert len(found) == 1 and found[0].location is not None
    assert found[0].location.source.endswith("# the user's own wait")
