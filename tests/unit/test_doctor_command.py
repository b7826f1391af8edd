"""`ddpgraph doctor` as a command: arguments, usage errors (exit 2), `--env`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddpgraph import Code
from ddpgraph.app.cli import build_parser, main
from ddpgraph.doctor.env import SCHEMA, collect, parse_version, relevant_variables, version_findings


def test_script_arguments_pass_through_untouched() -> None:
    args = build_parser().parse_args(
        ["doctor", "--nproc", "2", "train.py", "--json", "--lr", "3e-4", "-x"]
    )
    assert (args.nproc, args.json, args.script) == (2, False, "train.py")
    assert args.script_args == ["--json", "--lr", "3e-4", "-x"]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["doctor"], "expected a script to run"),
        (["doctor", "no_such_script.py"], "got no such file: 'no_such_script.py'"),
        (["doctor", str(Path(__file__).parent)], "expected a Python script file, got a directory"),
        (["doctor", "--env", "train.py"], "expected no script"),
        (["doctor", "--nproc", "0", __file__], "expected a number >= 1"),
        (["doctor", "--timeout", "0", __file__], "expected seconds > 0"),
    ],
)
def test_usage_errors_exit_2(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "[INVALID_ARGUMENT]" in err and expected in err and "HINT:" in err


def test_unknown_option_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["doctor", "--no-such-option"])
    assert info.value.code == 2


def test_env_json_on_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["doctor", "--env", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == SCHEMA
    assert data["versions"]["torch"] == str(torch.__version__)
    assert {f["name"] for f in data["features"]} >= {
        "CUDA graphs",
        "NCCL collectives inside graphs",
    }
    codes = [f["code"] for f in data["findings"]]
    # As for a script: NO_CUDA alone means nothing could be checked (3).
    assert status == (3 if codes == [Code.NO_CUDA.value] else 1 if codes else 0)
    if not torch.cuda.is_available():
        assert codes == [Code.NO_CUDA.value] and status == 3
        assert data["gpus"] == [] and data["versions"]["nccl"] is None


def test_env_in_the_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    main(["doctor", "--env"])
    out = capsys.readouterr().out
    assert "capture features" in out and "versions" in out


def test_version_findings() -> None:
    assert version_findings((2, 11, 0), (2, 28, 9)) == []
    assert [f.code for f in version_findings((2, 3, 1), None)] == [Code.TORCH_TOO_OLD]
    [nccl] = version_findings((2, 11), (2, 9, 5))
    assert nccl.code is Code.NCCL_TOO_OLD and "2.9.5" in nccl.happened and "2.9.6" in nccl.happened
    assert version_findings((2, 11), (2, 9, 6)) == []


def test_parse_version() -> None:
    assert parse_version("2.11.0+cu130") == (2, 11, 0)
    assert parse_version("12.4") == (12, 4)
    assert parse_version(None) is None and parse_version("dev") is None


def test_relevant_variables() -> None:
    env = {
        "NCCL_DEBUG": "INFO",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "CUDA_LAUNCH_BLOCKING": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "HOME": "/root",
        "PATH": "/bin",
    }
    assert set(relevant_variables(env)) == set(env) - {"HOME", "PATH"}


def test_collect_reports_features_with_reasons() -> None:
    report = collect()
    assert all(f.detail for f in report.features)
    assert any(f.name.startswith("capturable optimizers") and f.available for f in report.features)
