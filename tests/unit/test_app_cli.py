"""The `ddpgraph` command's dispatch, in process and as the installed console script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ddpgraph
from ddpgraph.app.cli import main


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as info:
        main(argv)
    code = info.value.code
    return int(code) if code is not None else 0


def test_help_lists_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: ddpgraph" in out
    assert "demo" in out and "train a small GPT eagerly and captured" in out


def test_no_command_prints_help_and_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: ddpgraph" in capsys.readouterr().out


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["no-such-command"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"ddpgraph {ddpgraph.__version__}"


def test_demo_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: ddpgraph demo" in out
    for option in ("--steps", "--batch", "--nproc", "--json", "--cpu"):
        assert option in out
    assert "torchrun --nproc_per_node=2 -m ddpgraph demo" in out  # the module docstring


def test_demo_rejects_a_bad_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["demo", "--steps", "many"]) == 2
    assert "--steps" in capsys.readouterr().err


def _clean_env() -> dict[str, str]:
    # Outside torchrun, as a user's shell would be.
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    return {k: v for k, v in os.environ.items() if k not in drop}


@pytest.fixture(scope="module")
def console_script() -> Path:
    script = Path(sys.executable).parent / ("ddpgraph.exe" if os.name == "nt" else "ddpgraph")
    if not script.exists():
        pytest.skip(
            f"the console script is not installed next to {sys.executable} (pip install -e .)"
        )
    return script


@pytest.mark.slow  # a child process that imports torch
def test_console_script_help(console_script: Path) -> None:
    proc = subprocess.run(
        [str(console_script), "--help"],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "demo" in proc.stdout


@pytest.mark.slow  # a child process that imports torch
def test_console_script_without_command_exits_2(console_script: Path) -> None:
    proc = subprocess.run(
        [str(console_script)],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "usage: ddpgraph" in proc.stdout
