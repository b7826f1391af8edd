"""Every argument of `ddpgraph demo` and `ddpgraph bench` is checked in the launching
process, before any worker starts: the first bad one is reported in the one template
(code, expected, given, fix) with exit status 2, and nothing runs.

The launcher's own `--nproc` never reaches torchrun's parser, and every other option
passes through it untouched (torchrun's parser reads the workers' arguments first, and
stops at anything it takes for an abbreviation of its own options).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.run import get_args_parser

from ddpgraph.app import cli, demo, launch
from ddpgraph.bench import command as bench

_started: list[list[str]] = []


@pytest.fixture(autouse=True)
def _no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A check that passed would start torchrun: record the call instead."""
    _started.clear()
    for module in (demo, bench):
        monkeypatch.setattr(
            module, "run_under_torchrun", lambda argv, n=None: _started.append(argv) or 0
        )
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = cli.main(argv)
    return status, capsys.readouterr().err


BAD = [
    (["demo", "--batch", "0"], "`--batch`: expected at least 1, got 0"),
    (["demo", "--batch", "-1"], "`--batch`: expected at least 1, got -1"),
    (["demo", "--steps", "0"], "`--steps`: expected at least 2, got 0"),
    (["demo", "--steps", "-5"], "`--steps`: expected at least 2, got -5"),
    (["demo", "--nproc", "0"], "`--nproc`: expected at least 1, got 0"),
    (
        ["demo", "--json", "/no/such/dir/x.json"],
        "`--json`: expected a file in an existing folder, got '/no/such/dir/x.json'",
    ),
    (["demo", "--json", "/"], "`--json`: expected a file name, got the folder '/'"),
    (["bench", "--plot", "x.txtx"], "`--plot`: expected a file ending in one of"),
    (["bench", "--plot", "bench"], "`--plot`: expected a file ending in one of"),
    (["bench", "--plot", "/no/such/dir/x.png"], "`--plot`: expected a file in an existing folder"),
    (["bench", "--json", "/no/such/dir/x.json"], "`--json`: expected a file in an existing folder"),
    (["bench", "--nproc=0"], "`--nproc`: expected at least 1, got 0"),
    (["bench", "--steps", "0"], "`--steps`: expected at least 1, got 0"),
    (["bench", "--batch-sizes", "0"], "`--batch-sizes`: expected positive integers"),
    (["bench", "--batch-sizes", "-1"], "`--batch-sizes`: expected positive integers"),
    (["bench", "--loader-workers", "-1"], "`--loader-workers`: expected at least 0, got -1"),
]


@pytest.mark.parametrize(("argv", "expected"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_argument_exits_2_before_any_worker(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = _run(argv, capsys)
    assert status == 2 and _started == []
    first, hint = err.strip().splitlines()
    assert first.startswith("[INVALID_ARGUMENT] ") and expected in first, err
    assert hint.startswith("HINT: ") and len(hint) > len("HINT: ") + 10


def test_more_processes_than_gpus_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    status, err = _run(["demo", "--nproc", "2"], capsys)
    assert status == 2 and "`--nproc`: expected at most 1, one process per GPU, got 2" in err
    assert "add --cpu for CPU processes" in err
    assert _run(["demo", "--nproc", "2", "--cpu"], capsys)[0] == 0  # CPU processes: any number


@pytest.mark.skipif(os.name == "nt" or os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tmp_path.chmod(0o500)
    try:
        status, err = _run(["demo", "--json", str(tmp_path / "x.json")], capsys)
    finally:
        tmp_path.chmod(0o700)
    assert status == 2 and "expected a folder this user can write to" in err


def test_good_arguments_start_the_workers_without_nproc(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "d.json")
    assert _run(["demo", "--nproc", "2", "--steps", "4", "--json", out], capsys)[0] == 0
    assert _run(["bench", "--nproc=2", "--plot", str(tmp_path / "b.svg")], capsys)[0] == 0
    assert launch.worker_args(_started[0]) == ["demo", "--steps", "4", "--json", out]
    assert launch.worker_args(_started[1]) == ["bench", "--plot", str(tmp_path / "b.svg")]


def test_abbreviated_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # Passed on, `--npro` would be torchrun's problem; the command refuses it itself.
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--npro", "2"])
    assert info.value.code == 2 and "--npro" in capsys.readouterr().err


def _options(command: str) -> list[str]:
    parser = cli.build_parser(command)
    sub = next(a for a in parser._actions if a.dest == "command")
    child = sub.choices[command]  # type: ignore[index]
    return [o for a in child._actions for o in a.option_strings if o.startswith("--")]


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_torchrun_passes_every_option_to_the_workers(command: str) -> None:
    parser = get_args_parser()
    for option in _options(command):
        argv = [command, option, "1"]
        worker = launch.worker_args(argv)
        launched = launch.torchrun_command(worker, 2)[3:]  # after `python -m torch.distributed.run`
        parsed = parser.parse_args(launched)
        assert [parsed.training_script, *parsed.training_script_args] == ["ddpgraph", *worker], (
            option
        )


@pytest.mark.slow  # two child processes that import torch
def test_as_typed_in_a_shell_exit_2_without_a_traceback() -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK"}}
    for argv in (["demo", "--batch", "-1"], ["bench", "--plot", "x.txtx"]):
        done = subprocess.run(
            [sys.executable, "-m", "ddpgraph", *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("[INVALID_ARGUMENT] ") and "Traceback" not in done.stderr
        assert done.stdout == ""
