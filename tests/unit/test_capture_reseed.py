"""A step that re-seeds PyTorch's generator inside it: eager calls restart the random
numbers every call, replays cannot, so the probe step refuses it at the seeding line
and training goes on eagerly, as the loop trains without ddpgraph."""

from __future__ import annotations

import warnings

import pytest
import torch

import ddpgraph
from ddpgraph import Code, StepState

BACKENDS = {"pass-through": ddpgraph.PassThroughBackend, "recording": ddpgraph.RecordingBackend}


def _reseeding(run) -> None:
    def inside() -> None:
        torch.manual_seed(1234)  # the re-seeding line

    run.inside = inside


@pytest.mark.parametrize("kind", list(BACKENDS))
def test_a_step_that_reseeds_is_refused_at_the_line(make_run, batches, same, kind: str) -> None:
    data = batches(14)
    ref = make_run(graph_safe=True)
    _reseeding(ref)
    expected = ref.train(data)
    run = make_run()
    _reseeding(run)
    seeders = (torch.manual_seed, torch.random.manual_seed, torch.cuda.manual_seed_all)
    step = run.capture(backend=BACKENDS[kind]())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ddpgraph.DdpGraphWarning)
        got = run.train(data, step)
    assert step.state is StepState.EAGER and step.stats.captures == 0
    reason = step.reason
    assert reason is not None and reason.code is Code.UNSUPPORTED_SETUP, reason
    assert "re-seeds PyTorch's random generator" in reason.happened
    assert reason.location is not None and reason.location.filename == __file__
    assert reason.location.source == "torch.manual_seed(1234)  # the re-seeding line"
    # PyTorch's own functions, put back.
    assert (torch.manual_seed, torch.random.manual_seed, torch.cuda.manual_seed_all) == seeders
    assert got.losses == expected.losses
    assert same(run.params(), ref.params())
