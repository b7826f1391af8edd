"""`capture_step(parity=...)`: at capture, the same step eagerly and replayed, compared."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import ddpgraph
from ddpgraph import Code, ParityCheck
from ddpgraph.step.parity import as_parity_check, relative_difference
from perturbed import FirstReplayPerturbed


def test_parity_argument_forms() -> None:
    assert as_parity_check(None) is None and as_parity_check(False) is None
    assert as_parity_check(True) == ParityCheck(rtol=0.0)
    assert as_parity_check(ParityCheck(rtol=1e-6)) == ParityCheck(rtol=1e-6)
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="parity"):
        as_parity_check(1e-6)  # type: ignore[arg-type]
    with pytest.raises(ddpgraph.DdpGraphUsageError, match="rtol"):
        ParityCheck(rtol=-1.0)


def test_relative_difference() -> None:
    a = torch.tensor([1.0, -4.0])
    assert relative_difference(a, a.clone()) == 0.0
    assert relative_difference(a, torch.tensor([1.0, -3.0])) == pytest.approx(0.25)
    assert relative_difference(torch.zeros(2), torch.tensor([0.0, 1e-3])) == pytest.approx(1e-3)
    assert relative_difference(a, torch.zeros(3)) == float("inf")


def test_a_passing_check_leaves_training_as_without_it(make_run, batches, same) -> None:
    data = batches(16)
    ref = make_run()
    expected = ref.train(data, ref.capture())
    run = make_run()
    step = run.capture(parity=True)
    got = run.train(data, step)
    assert got.states == ["warmup"] * 11 + ["captured"] * 5
    assert step.reason is None and step.stats.replays == 5
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())
    assert same(run.buffers(), ref.buffers())  # batch-norm statistics: the check's step undone


def _perturbed_capture(run, size: float, **kw):
    return ddpgraph.capture_step(
        run.step,
        model=run.model,
        optimizer=run.optimizer,
        backend=FirstReplayPerturbed(run.model, size),
        **kw,
    )


def test_a_mismatch_is_a_finding_with_its_size_and_training_continues_eagerly(
    make_run, batches, same
) -> None:
    data = batches(14)
    ref = make_run(graph_safe=True)
    expected = ref.train(data)
    run = make_run()
    step = _perturbed_capture(run, 1e-3, parity=ParityCheck(rtol=1e-6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run.train(data, step)
    assert got.states == ["warmup"] * 11 + ["eager"] * 3
    reason = step.reason
    assert reason is not None and reason.code is Code.PARITY_MISMATCH
    assert "parameters by" in reason.happened and "rtol=1e-06" in reason.happened
    assert any("[PARITY_MISMATCH]" in str(w.message) for w in caught)
    # The failed check put the state back and ran the call eagerly: as eager training.
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())


def test_a_difference_within_tolerance_passes(make_run, batches) -> None:
    run = make_run()
    step = _perturbed_capture(run, 1e-9, parity=ParityCheck(rtol=1e-3))
    got = run.train(batches(13), step)
    assert got.states[-1] == "captured" and step.reason is None


def test_a_mismatch_with_on_failure_raise(make_run, batches) -> None:
    run = make_run()
    step = _perturbed_capture(run, 1e-3, parity=True, on_failure="raise")
    with pytest.raises(ddpgraph.DdpGraphError) as info:
        run.train(batches(13), step)
    assert info.value.code is Code.PARITY_MISMATCH
    assert "bit-for-bit" in str(info.value)


def test_a_mismatch_after_a_library_synchronised_names_that_branch_as_the_likely_cause(
    library_sync: Any,
) -> None:
    # A library that synchronised in the probe step and skips it while a graph is recorded
    # (transformers' mask building) runs another branch in the graph: the finding says so,
    # with the user's line and the library's.
    from ddpgraph.step.parity import ParityRun

    model = torch.nn.Linear(2, 2)
    with_branch = ParityRun(ParityCheck(rtol=0.0), model, [], library_branch=library_sync)
    plain = ParityRun(ParityCheck(rtol=0.0), model, [])
    for run in (with_branch, plain):
        run.parameter_difference = 2.1e-4
    named, unnamed = with_branch._judge(), plain._judge()
    assert named is not None and unnamed is not None
    assert named.code is unnamed.code is Code.PARITY_MISMATCH and "0.00021" in named.happened
    assert (
        "(train.py:57)" in named.happened and "transformers/masking_utils.py:761" in named.happened
    )
    assert "ParityCheck(rtol=" in named.fix
    assert "likely cause" not in unnamed.happened and unnamed.fix == ""
