"""The doctor's bookkeeping and rules (`ddpgraph.doctor.recorder`), driven on CPU by
calling the events the instrumentation would send, with stand-ins for CUDA graphs and
streams and a plain module standing in for DDP."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ddpgraph import Code
from ddpgraph.doctor.observed import StreamInfo, storage_key
from ddpgraph.doctor.recorder import Recorder
from ddpgraph.findings import Location

SIDE = StreamInfo(7, False)
DEFAULT = StreamInfo(0, True)
DDP_AT = Location("train.py", 10, "ddp = DDP(model)")
OPT_AT = Location("train.py", 11, "opt = AdamW(...)")
CAPTURE_AT = Location("train.py", 20, "with torch.cuda.graph(g):")
REPLAY_AT = Location("train.py", 30, "g.replay()")
LOAD_AT = Location("train.py", 40, "opt.load_state_dict(ckpt)")
INVALIDATED = RuntimeError("CUDA error: operation failed due to a previous error during capture")


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: only its identity matters."""


class Setup:
    def __init__(
        self, *, built_on: StreamInfo | None = SIDE, lr: float | torch.Tensor = 1e-2
    ) -> None:
        self.rec = Recorder()
        torch.manual_seed(0)
        self.model = nn.Linear(4, 2)
        self.rec.ddp_built(self.model, DDP_AT, built_on)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.rec.optimizer_built(self.opt, OPT_AT)
        self.x = torch.randn(3, 4)
        self.graph = FakeGraph()

    def iteration(self, x: torch.Tensor | None = None, *, backward: bool = True) -> None:
        x = self.x if x is None else x
        self.rec.ddp_forward(self.model, [x])
        out = self.model(x).sum()
        if backward:
            out.backward()
            self.rec.backward()
            self.opt.step()
            self.rec.optimizer_step(self.opt)
            self.opt.zero_grad()

    def warm_up(self, n: int) -> None:
        for _ in range(n):
            self.iteration()

    def capture(self, errors: list[BaseException] | None = None) -> None:
        self.rec.capture_begin(self.graph, CAPTURE_AT, SIDE, lambda: {storage_key(self.x)})
        self.iteration()
        self.rec.capture_end(self.graph, errors or [])

    def replay(self, *, new_data: bool = True) -> None:
        if new_data:
            self.x.copy_(torch.randn(3, 4))
        self.rec.replay(self.graph, lambda: REPLAY_AT)

    def codes(self) -> list[Code]:
        return [f.code for f in self.rec.findings]


def test_correct_recipe_is_clean_and_counted() -> None:
    s = Setup(lr=torch.tensor(1e-2))
    s.warm_up(11)
    s.capture()
    for step in range(5):
        s.replay()
        s.opt.param_groups[0]["lr"].fill_(1e-2 * 0.5**step)  # a scheduler on a tensor lr
    assert s.rec.findings == []
    record = s.rec.record()
    assert (record.graphs.captured, record.graphs.replays) == (1, 5)
    assert (record.ddp_graphs.captured, record.ddp_graphs.replays) == (1, 5)
    assert record.ddp_graphs.capture_location == CAPTURE_AT


def test_warmup_too_short_names_the_capture_with_counts() -> None:
    s = Setup()
    s.warm_up(1)
    s.capture([INVALIDATED])
    [finding] = s.rec.findings
    assert finding.code is Code.WARMUP_TOO_SHORT
    assert finding.location == CAPTURE_AT
    assert "forward number 2, after 1 iteration with backward" in finding.happened
    assert "needs 11" in finding.happened
    assert s.rec.record().graphs.failed == 1


def test_forward_only_warmups_do_not_count() -> None:
    s = Setup()
    for _ in range(11):
        s.iteration(backward=False)
    s.capture([INVALIDATED])
    [finding] = s.rec.findings
    assert finding.code is Code.WARMUP_TOO_SHORT
    assert "forward number 12, after 0 iterations with backward" in finding.happened


def test_forwards_without_grad_are_not_reducer_iterations() -> None:
    s = Setup()
    with torch.no_grad():
        for _ in range(11):
            s.rec.ddp_forward(s.model, [s.x])
    s.capture([INVALIDATED])
    assert "forward number 1," in s.rec.findings[0].happened


def test_capture_on_a_sampled_iteration_asks_for_more() -> None:
    s = Setup()
    s.warm_up(99)
    s.capture([INVALIDATED])
    [finding] = s.rec.findings
    assert "forward number 100" in finding.happened and "needs 101" in finding.happened


def test_enough_warmup_gives_no_warmup_finding() -> None:
    s = Setup()
    s.warm_up(11)
    s.capture([INVALIDATED])
    assert s.codes() == [Code.CAPTURE_FAILED]


def test_ddp_built_on_the_default_stream_names_the_ddp_line() -> None:
    s = Setup(built_on=DEFAULT)
    s.warm_up(11)
    s.capture([INVALIDATED])
    [finding] = s.rec.findings
    assert finding.code is Code.DDP_STREAM_MISMATCH
    assert finding.location == DDP_AT


def test_ddp_on_the_default_stream_is_not_reported_when_the_capture_works() -> None:
    s = Setup(built_on=DEFAULT)
    s.warm_up(11)
    s.capture()
    assert s.rec.findings == []


def test_stream_warning_during_capture_is_a_stream_mismatch() -> None:
    s = Setup()
    s.warm_up(11)
    s.rec.capture_begin(s.graph, CAPTURE_AT, SIDE)
    s.rec.warning("The AccumulateGrad node's stream does not match the stream of the node ...")
    s.rec.capture_end(s.graph, [INVALIDATED])
    assert s.codes() == [Code.DDP_STREAM_MISMATCH]


def test_python_lr_changed_after_capture_is_baked() -> None:
    s = Setup(lr=1e-2)
    s.warm_up(11)
    s.capture()
    s.replay()
    assert s.rec.findings == []
    s.opt.param_groups[0]["lr"] = 1e-3
    s.replay()
    s.opt.param_groups[0]["lr"] = 1e-4
    s.replay()
    [finding] = s.rec.findings
    assert finding.code is Code.LR_BAKED_INTO_GRAPH
    assert finding.location == OPT_AT
    assert "['lr']` was 0.01" in finding.happened and "0.001 now" in finding.happened


def test_tensor_lr_replaced_by_another_value_is_baked() -> None:
    s = Setup(lr=torch.tensor(1e-2))
    s.warm_up(11)
    s.capture()
    s.opt.param_groups[0]["lr"] = torch.tensor(1e-2)  # another tensor, same value: fine for now
    s.replay()
    assert s.rec.findings == []
    s.opt.param_groups[0]["lr"] = torch.tensor(5e-3)
    s.replay()
    assert s.codes() == [Code.LR_BAKED_INTO_GRAPH]


def test_unchanged_hyperparameters_of_an_optimizer_outside_the_graph_are_ignored() -> None:
    s = Setup()
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    s.warm_up(11)
    s.capture()
    other.param_groups[0]["lr"] = 0.01  # not stepped inside the capture
    s.replay()
    assert s.rec.findings == []


def test_optimizer_load_state_dict_after_capture_replaces_state() -> None:
    s = Setup()
    s.warm_up(11)
    s.capture()
    checkpoint = copy.deepcopy(s.opt.state_dict())
    s.replay()
    s.opt.load_state_dict(checkpoint)
    s.rec.state_loaded(s.opt, LOAD_AT)
    s.replay()
    s.replay()
    [finding] = s.rec.findings
    assert finding.code is Code.OPTIMIZER_STATE_REPLACED
    assert finding.location == LOAD_AT


def test_loading_the_same_tensors_back_is_fine() -> None:
    s = Setup()
    s.warm_up(11)
    s.capture()
    s.opt.load_state_dict(s.opt.state_dict())  # same tensor objects
    s.rec.state_loaded(s.opt, LOAD_AT)
    s.replay()
    assert s.rec.findings == []


@pytest.mark.parametrize("assign", [False, True])
def test_module_load_replaces_parameters_only_with_assign(assign: bool) -> None:
    s = Setup()
    s.warm_up(11)
    s.capture()
    s.model.load_state_dict(copy.deepcopy(s.model.state_dict()), assign=assign)
    s.rec.state_loaded(s.model, LOAD_AT)
    s.replay()
    assert s.codes() == ([Code.OPTIMIZER_STATE_REPLACED] if assign else [])


def test_replays_without_new_data_in_the_inputs() -> None:
    s = Setup()
    s.warm_up(11)
    s.capture()
    s.replay(new_data=False)  # the captured batch: fine
    s.replay(new_data=True)
    assert s.rec.findings == []
    s.replay(new_data=False)
    s.replay(new_data=False)
    [finding] = s.rec.findings
    assert finding.code is Code.STATIC_INPUT_CHANGED
    assert finding.location == REPLAY_AT
    assert (
        "replay 3" in finding.happened
        and "DDP forward argument 0 (3x4 float32)" in finding.happened
    )


def test_inputs_made_inside_the_capture_are_not_tracked() -> None:
    s = Setup()
    s.warm_up(11)
    s.rec.capture_begin(s.graph, CAPTURE_AT, SIDE, set)  # nothing existed before
    s.iteration()
    s.rec.capture_end(s.graph, [])
    for _ in range(3):
        s.replay(new_data=False)
    assert s.rec.findings == []


def test_a_view_of_a_live_input_made_inside_the_capture_is_not_freed() -> None:
    # capture_step's own graphs read `batch[:, :-1]` of the static batch: the view dies
    # with the capture, its storage does not.
    s = Setup()
    s.warm_up(11)
    batch = [torch.randn(3, 5)]
    s.rec.capture_begin(s.graph, CAPTURE_AT, SIDE, lambda: {storage_key(batch[0])})
    s.iteration(batch[0][:, :-1])
    s.rec.capture_end(s.graph, [])
    for _ in range(3):
        batch[0].copy_(torch.randn(3, 5))
        s.rec.replay(s.graph, lambda: REPLAY_AT)
    assert s.rec.findings == []
    batch.clear()  # the storage itself goes: now it is freed
    s.rec.replay(s.graph, lambda: REPLAY_AT)
    [finding] = s.rec.findings
    assert finding.code is Code.STATIC_INPUT_CHANGED and "freed" in finding.happened


def test_freed_input_is_reported() -> None:
    s = Setup()
    s.warm_up(11)
    s.capture()
    s.x = torch.randn(3, 4)  # the captured input's last reference goes away
    s.replay()
    [finding] = s.rec.findings
    assert finding.code is Code.STATIC_INPUT_CHANGED and "freed" in finding.happened


def test_error_from_a_diagnosed_capture_is_not_reported_again() -> None:
    s = Setup()
    s.warm_up(1)
    s.capture([INVALIDATED])
    s.rec.script_error(INVALIDATED)
    assert s.codes() == [Code.WARMUP_TOO_SHORT]


def test_other_errors_are_script_failures_at_their_line() -> None:
    rec = Recorder()
    try:
        raise ValueError("bad batch")
    except ValueError as err:
        rec.script_error(err)
    [finding] = rec.findings
    assert finding.code is Code.SCRIPT_FAILED
    assert finding.happened == "ValueError: bad batch"
    assert (
        finding.location is not None and finding.location.source == 'raise ValueError("bad batch")'
    )


def test_exit_status_is_a_script_failure() -> None:
    rec = Recorder()
    rec.script_error(SystemExit(3))
    assert rec.findings[0].code is Code.SCRIPT_FAILED and "status 3" in rec.findings[0].happened


def test_copying_a_short_batch_into_a_captured_input() -> None:
    s = Setup()
    s.warm_up(11)
    s.capture()
    short = torch.randn(2, 4)
    try:
        s.x.copy_(short)
    except RuntimeError as err:
        s.rec.failed_write(s.x, short, tuple(s.x.shape), err, REPLAY_AT)
        s.rec.script_error(err)
    [finding] = s.rec.findings
    assert finding.code is Code.STATIC_INPUT_CHANGED
    assert finding.location == REPLAY_AT
    assert "shape 2x4" in finding.happened and "3x4 expected" in finding.happened


def test_a_failed_copy_into_another_tensor_is_not_a_static_input_change() -> None:
    s = Setup()
    s.warm_up(11)
    s.capture()
    history = torch.zeros(3)
    try:
        history.copy_(torch.ones(5))
    except RuntimeError as err:
        s.rec.failed_write(history, torch.ones(5), (3,), err, REPLAY_AT)
        s.rec.script_error(err)
    assert s.codes() == [Code.SCRIPT_FAILED]
