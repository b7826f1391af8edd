"""`ddpgraph.step.step_settings`: the one place the AdamW kernel and DDP's bucketing are chosen."""

from __future__ import annotations

import pytest
import torch

from bench_args import parse, plan
from ddpgraph.app.models import mlp_workload
from ddpgraph.bench.case import Case
from ddpgraph.bench.suite import describe_setup
from ddpgraph.ddp.distributed import DistInfo
from ddpgraph.step.step_settings import (
    ADAM_KERNELS,
    DEFAULT_STEP_SETTINGS,
    StepSettings,
    fused_adam_takes_tensor_lr,
)


def test_the_defaults_are_pytorchs() -> None:
    assert DEFAULT_STEP_SETTINGS.ddp_kwargs() == {}
    opt = DEFAULT_STEP_SETTINGS.adamw([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    reference = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    assert opt.defaults == reference.defaults


@pytest.mark.parametrize(
    ("kernel", "foreach", "fused"),
    [
        ("default", None, None),
        ("foreach", True, None),
        ("fused", None, True),
        ("single", False, None),
    ],
)
def test_each_kernel_reaches_adamw(kernel: str, foreach: bool | None, fused: bool | None) -> None:
    settings = StepSettings(adam_kernel=kernel)  # type: ignore[arg-type]
    opt = settings.adamw(
        [torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(1e-3), capturable=True
    )
    assert opt.defaults["foreach"] is foreach and opt.defaults["fused"] is fused
    assert opt.defaults["capturable"] is True
    assert set(ADAM_KERNELS) == {"default", "foreach", "fused", "single"}


def test_an_unknown_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match="adam_kernel"):
        StepSettings(adam_kernel="apex")  # type: ignore[arg-type]


def test_ddp_settings_are_only_what_is_set() -> None:
    settings = StepSettings(gradient_as_bucket_view=True, bucket_cap_mb=100)
    assert settings.ddp_kwargs() == {"gradient_as_bucket_view": True, "bucket_cap_mb": 100}
    assert StepSettings(gradient_as_bucket_view=False).ddp_kwargs() == {
        "gradient_as_bucket_view": False
    }


def test_the_bench_takes_its_optimizer_and_ddp_settings_from_here() -> None:
    case = Case(mlp_workload(), 8, torch.device("cpu"), None)
    assert case.ddp_kwargs() == DEFAULT_STEP_SETTINGS.ddp_kwargs()
    opt = case.optimizer(torch.nn.Linear(2, 2))
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["foreach"] is None


def test_fused_adam_reads_a_tensor_learning_rate_on_this_torch() -> None:
    # Every supported torch (2.11..2.13) has the overload; the probe depends on it.
    assert fused_adam_takes_tensor_lr()


def test_the_bench_records_the_settings_it_ran_with() -> None:
    setup = describe_setup(
        DistInfo(0, 1, 0, torch.device("cpu"), "gloo"), plan(parse("--model", "mlp")), []
    )
    assert setup["settings"]["step_settings"] == {
        "adam_kernel": "default",
        "gradient_as_bucket_view": None,
        "bucket_cap_mb": None,
    }
