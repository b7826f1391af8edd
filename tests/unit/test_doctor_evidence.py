"""The doctor's rules decided from recorded evidence, on CPU: where DDP's gradient
accumulators live (the stream warning alone names no cause), what a failed write went
into, ddpgraph's own decisions (a step that gave up, calls its graph could not serve),
and the absence of a GPU, with the report's status and exit code for it."""

from __future__ import annotations

import os
import traceback

import pytest
import torch
from torch import nn

from ddpgraph import Code, DdpGraphUsageError, Finding
from ddpgraph.doctor.failure_rules import capture_failure_findings, script_error_finding
from ddpgraph.doctor.observed import DdpForward, DdpModel, Graph, StreamInfo
from ddpgraph.doctor.recorder import Recorder
from ddpgraph.doctor.records import GraphCounts, RankRecord, RankStatus
from ddpgraph.doctor.report import EXIT_UNCHECKED, build_report
from ddpgraph.doctor.run import RunResult
from ddpgraph.findings import Location
from ddpgraph.probe.diagnose import STREAM_WARNING
from ddpgraph.probe.syncs import SyncEvent

SIDE = StreamInfo(7, False)
DEFAULT = StreamInfo(0, True)
DDP_AT = Location("train.py", 10, "ddp = DDP(model)")
CALL_AT = Location("train.py", 30, "loss = step(x, y)")
INVALIDATED = RuntimeError("CUDA error: operation failed due to a previous error during capture")
WARNING = f"The {STREAM_WARNING} the stream of the node that produced the incoming gradient."
ITEM = SyncEvent(
    [traceback.FrameSummary(os.path.abspath("train.py"), 42, "step", line="total += loss.item()")]
)


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: only its identity matters."""


def captured_graph(
    built_on: StreamInfo | None, *, ddp: bool = True, backward_stream: StreamInfo | None = None
) -> Graph:
    graph = Graph(1, Location("train.py", 20, "with torch.cuda.graph(g):"), SIDE, backward_stream)
    if ddp:
        graph.forwards.append(DdpForward(DdpModel(DDP_AT, built_on), 12, 11))
    graph.warnings.append(WARNING)
    return graph


def codes(findings: list[Finding]) -> list[Code]:
    return [f.code for f in findings]


def test_stream_warning_with_ddp_built_on_a_side_stream_names_only_the_real_cause() -> None:
    # PyTorch's recipe captured on the graph's own stream warns, and captures fine: the
    # failure is the .item().
    found = capture_failure_findings(captured_graph(SIDE), [INVALIDATED], [ITEM])
    assert codes(found) == [Code.HOST_SYNC_IN_CAPTURE]


def test_ddp_built_on_the_default_stream_is_the_cause() -> None:
    found = capture_failure_findings(captured_graph(DEFAULT), [INVALIDATED], [])
    assert codes(found) == [Code.DDP_STREAM_MISMATCH]
    assert found[0].location == DDP_AT


def test_without_ddp_the_first_backwards_stream_decides() -> None:
    on_side = capture_failure_findings(
        captured_graph(None, ddp=False, backward_stream=SIDE), [INVALIDATED], [ITEM]
    )
    on_default = capture_failure_findings(
        captured_graph(None, ddp=False, backward_stream=DEFAULT), [INVALIDATED], []
    )
    unknown = capture_failure_findings(captured_graph(None, ddp=False), [INVALIDATED], [])
    assert codes(on_side) == [Code.HOST_SYNC_IN_CAPTURE]
    assert codes(on_default) == [Code.DDP_STREAM_MISMATCH]
    assert codes(unknown) == [Code.DDP_STREAM_MISMATCH]  # nothing says otherwise


def test_the_recorder_gives_a_capture_the_stream_of_the_first_backward() -> None:
    rec = Recorder()
    rec.backward(DEFAULT)
    rec.backward(SIDE)
    rec.capture_begin(FakeGraph(), None, SIDE)
    assert rec._capturing is not None and rec._capturing.backward_stream == DEFAULT


# ---------------------------------------------------------------------- ddpgraph's decisions
def test_a_ddpgraph_error_keeps_its_code() -> None:
    rec = Recorder()
    error = DdpGraphUsageError(Finding(Code.UNSUPPORTED_INPUT, "argument `args[0]` is a Batch"))
    try:
        raise error
    except DdpGraphUsageError as err:
        rec.script_error(err)
    [finding] = rec.findings
    assert finding.code is Code.UNSUPPORTED_INPUT and finding.location is not None
    assert finding.location.filename == __file__


def test_a_step_that_gave_up_is_reported_once_with_the_users_line() -> None:
    rec = Recorder()
    sync = Finding(
        Code.HOST_SYNC_IN_CAPTURE, "x waits", location=Location("model.py", 5, "x.item()")
    )
    rec.ddpgraph_gave_up(sync, CALL_AT)
    rec.ddpgraph_gave_up(sync, CALL_AT)
    [finding] = rec.findings
    assert finding.code is Code.HOST_SYNC_IN_CAPTURE and finding.location == sync.location


def test_a_few_odd_batches_run_eagerly_are_no_finding() -> None:
    rec = Recorder()
    rec.counts.replays = 40
    rec.unserved_call(
        Finding(Code.INPUT_SIGNATURE_CHANGED, "args[0] changed from (8, 32) to (5, 32)"), CALL_AT
    )
    rec.script_ended()
    assert rec.findings == []


def test_a_graph_that_serves_fewer_calls_than_run_eagerly_is_reported() -> None:
    rec = Recorder()
    rec.counts.replays = 2
    for n in range(3):
        rec.unserved_call(Finding(Code.INPUT_SIGNATURE_CHANGED, f"args[0] changed ({n})"), CALL_AT)
    rec.script_ended()
    [finding] = rec.findings
    assert finding.code is Code.INPUT_SIGNATURE_CHANGED and finding.location == CALL_AT
    assert "3 calls ran eagerly" in finding.happened and "replayed 2 times" in finding.happened
    assert "args[0] changed (0)" in finding.happened


@pytest.mark.parametrize("code", [Code.MODEL_MODE_CHANGED, Code.MODULE_SETTING_CHANGED])
def test_a_step_called_with_the_model_changed_is_reported_at_once(code: Code) -> None:
    rec = Recorder()
    rec.unserved_call(Finding(code, "captured in train mode, called in eval mode"), CALL_AT)
    assert [(f.code, f.location) for f in rec.findings] == [(code, CALL_AT)]


# ---------------------------------------------------------------------- no GPU
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_error_from_torch_cuda_without_a_gpu_is_no_cuda() -> None:
    rec = Recorder()
    try:
        torch.cuda.CUDAGraph()
    except RuntimeError as err:  # "Tried to instantiate dummy base class CUDAGraph"
        rec.script_error(err)
    [finding] = rec.findings
    assert finding.code is Code.NO_CUDA
    assert finding.happened.startswith("nothing was checked because there is no GPU")
    assert finding.location is not None and "CUDAGraph()" in finding.location.source


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_ordinary_error_without_a_gpu_is_still_a_script_failure() -> None:
    rec = Recorder()
    try:
        nn.Linear(2, 2)(torch.zeros(3, 3))
    except RuntimeError as err:
        rec.script_error(err)
    assert codes(rec.findings) == [Code.SCRIPT_FAILED]


def test_a_step_that_ran_eagerly_for_want_of_cuda_is_no_cuda() -> None:
    rec = Recorder()
    rec.ddpgraph_gave_up(
        Finding(Code.NO_CUDA, "CUDA is not available; the step runs eagerly"), CALL_AT
    )
    [finding] = rec.findings
    assert finding.code is Code.NO_CUDA and finding.location == CALL_AT
    assert "nothing was checked because there is no GPU" in finding.happened


def _report(*findings: Finding) -> RunResult:
    records = [
        RankRecord(r, 2, 0, RankStatus.FINISHED, 0, list(findings), GraphCounts(), GraphCounts())
        for r in (0, 1)
    ]
    return RunResult(records, 0, False, 1.0)


def test_a_report_of_no_cuda_alone_is_unchecked_with_its_own_exit_status() -> None:
    no_gpu = Finding(Code.NO_CUDA, "nothing was checked because there is no GPU", location=CALL_AT)
    report = build_report("t.py", [], 2, 60, _report(no_gpu))
    assert report.exit_code == EXIT_UNCHECKED == 3
    assert report.to_json()["status"] == "unchecked"
    other = Finding(Code.SCRIPT_FAILED, "ValueError: x", location=CALL_AT)
    assert build_report("t.py", [], 2, 60, _report(no_gpu, other)).exit_code == 1


def test_the_terminal_report_says_plainly_that_nothing_was_checked() -> None:
    import io

    from rich.console import Console

    from ddpgraph.doctor.report import render

    out = io.StringIO()
    no_gpu = Finding(Code.NO_CUDA, "nothing was checked because there is no GPU", location=CALL_AT)
    render(
        build_report("t.py", [], 2, 60, _report(no_gpu)),
        Console(file=out, width=120, markup=False, highlight=False),
    )
    text = out.getvalue()
    assert (
        "Nothing was checked because there is no GPU." in text and "No problems found" not in text
    )


def test_a_syntax_error_is_located_at_its_own_line() -> None:
    try:
        compile("import torch\n\ndef main(:\n    pass\n", "/home/user/train.py", "exec")
    except SyntaxError as err:
        finding = script_error_finding(err)
    assert finding.code is Code.SCRIPT_FAILED and finding.happened.startswith("SyntaxError")
    assert finding.location is not None
    assert (finding.location.filename, finding.location.lineno) == ("/home/user/train.py", 3)
    assert finding.location.source == "def main(:"
