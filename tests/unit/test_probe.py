"""Naming a host synchronisation from its stack (`ddpgraph.probe.syncs`), and finding the
user's own frame in a stack."""

from __future__ import annotations

import os
import threading
import traceback
import warnings

import pytest
import torch

from ddpgraph import Code
from ddpgraph.probe.syncs import (
    ProbeResult,
    SyncEvent,
    classify,
    host_sync_probe,
    user_frame,
    user_location,
)

TORCH = os.path.dirname(torch.__file__)
SCRIPT = os.path.abspath("train.py")
STDLIB = os.path.dirname(os.__file__)


def frame(path: str, line: int, source: str = "") -> traceback.FrameSummary:
    return traceback.FrameSummary(path, line, "f", line=source)


def stack(*frames: traceback.FrameSummary) -> list[traceback.FrameSummary]:
    return list(frames)


USER = frame(SCRIPT, 42, "loss.item()")


def test_user_frame_skips_torch_stdlib_and_generated_code() -> None:
    frames = stack(
        frame(os.path.join(STDLIB, "runpy.py"), 88),
        USER,
        frame(os.path.join(TORCH, "_tensor.py"), 500),
        frame("<eval_with_key>.3", 1),
    )
    assert user_frame(frames) is USER


def test_user_frame_prefers_own_code_to_third_party_packages() -> None:
    from ddpgraph.probe.code_origin import SITE_DIRS

    if not SITE_DIRS:
        pytest.skip("no site-packages folder on this interpreter")
    library = frame(os.path.join(SITE_DIRS[0], "somelib", "trainer.py"), 7)
    assert user_frame(stack(USER, library)) is USER
    assert user_frame(stack(library)) is library


def test_user_location_of_the_caller() -> None:
    where = user_location()
    assert where is not None and where.filename == __file__
    assert "user_location()" in where.source


def test_plain_sync_is_a_host_sync_at_the_users_line() -> None:
    finding = classify(stack(USER))
    assert finding is not None and finding.code is Code.HOST_SYNC_IN_CAPTURE
    assert finding.location is not None and finding.location.lineno == 42
    assert "`loss.item()`" in finding.happened


def test_printing_a_tensor_is_a_host_sync_at_the_print() -> None:
    printed = frame(SCRIPT, 7, "print(loss)")
    finding = classify(stack(printed, frame(os.path.join(TORCH, "_tensor_str.py"), 300)))
    assert finding is not None and finding.code is Code.HOST_SYNC_IN_CAPTURE
    assert finding.location is not None and finding.location.lineno == 7


def test_grad_scaler_frames_name_the_scaler() -> None:
    scaler = frame(os.path.join(TORCH, "amp", "grad_scaler.py"), 380)
    finding = classify(stack(frame(SCRIPT, 9, "scaler.step(opt)"), scaler))
    assert finding is not None and finding.code is Code.GRAD_SCALER_IN_CAPTURE
    assert finding.location is not None and finding.location.lineno == 9


def test_optimizer_frames_name_the_optimizer() -> None:
    optim = frame(os.path.join(TORCH, "optim", "adagrad.py"), 120)
    finding = classify(stack(frame(SCRIPT, 11, "opt.step()"), optim))
    assert finding is not None and finding.code is Code.OPTIMIZER_NOT_CAPTURABLE


def test_ddp_sampling_is_harmless_eagerly_and_too_early_while_capturing() -> None:
    ddp = frame(os.path.join(TORCH, "nn", "parallel", "distributed.py"), 1600)
    frames = stack(frame(SCRIPT, 5, "out = ddp(x)"), ddp)
    assert classify(frames) is None
    finding = classify(frames, during_capture=True)
    assert finding is not None and finding.code is Code.WARMUP_TOO_SHORT
    assert finding.location is not None and finding.location.lineno == 5


def test_probe_result_keeps_one_finding_per_cause_and_place() -> None:
    result = ProbeResult(
        [
            SyncEvent(stack(USER)),
            SyncEvent(stack(USER)),
            SyncEvent(stack(frame(SCRIPT, 50, "x.cpu()"))),
        ]
    )
    assert [f.location.lineno for f in result.findings() if f.location] == [42, 50]


def test_probe_records_nothing_without_cuda() -> None:
    with host_sync_probe(enabled=True) as result:
        torch.ones(2).sum().item()
    assert result.events == []


def test_probe_keeps_only_this_threads_synchronisations(monkeypatch: pytest.MonkeyPatch) -> None:
    # Sync debug mode warns in every thread; a user's thread that synchronises while the
    # step runs (or a DataLoader's) is not the step's synchronisation.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    text = "called a synchronizing CUDA operation"

    def other() -> None:
        warnings.warn(text, UserWarning, stacklevel=1)

    with host_sync_probe() as result:
        thread = threading.Thread(target=other, name="poller")
        thread.start()
        thread.join()
        warnings.warn(text, UserWarning, stacklevel=1)  # this thread's
    assert len(result.events) == 1
    assert any(
        f.name == "test_probe_keeps_only_this_threads_synchronisations"
        for f in result.events[0].stack
    )
