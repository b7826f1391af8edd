"""The code passes the project's lint and type checks (ruff and mypy, configured in
pyproject.toml), so CI fails on either. mypy runs in the background from the start of the
session (tests/code_checks.py); the quick lane leaves it out (marked `slow`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import code_checks

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, check=False
    )


@pytest.mark.skipif(_run("ruff", "--version").returncode != 0, reason="ruff not installed")
def test_ruff_is_clean() -> None:
    result = _run("ruff", "check", "src", "tests", "scripts")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(_run("ruff", "--version").returncode != 0, reason="ruff not installed")
def test_ruff_reads_every_python_file_of_the_project() -> None:
    # Ruff's default exclusions hold "dist", the name of the multi-process tests' folder:
    # pyproject.toml lists its own, or `ruff check tests` passes over them without a word.
    listed = _run("ruff", "check", "--show-files", "src", "tests", "scripts").stdout.split()
    tracked = subprocess.run(
        ["git", "ls-files", "src/*.py", "tests/*.py", "scripts/*.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    assert sorted(set(tracked) - {str(Path(p).relative_to(REPO)) for p in listed}) == []


@pytest.mark.skipif(_run("mypy", "--version").returncode != 0, reason="mypy not installed")
@pytest.mark.slow
def test_mypy_is_clean() -> None:
    returncode, output = code_checks.mypy_result()
    assert returncode == 0, output


def test_mypy_starts_before_collection_only_where_its_test_may_run() -> None:
    here = str(code_checks.TEST_FILE)
    assert code_checks.may_run(["tests"], "") and code_checks.may_run([str(REPO)], "")
    assert code_checks.may_run([f"{here}::test_mypy_is_clean"], "slow")
    assert not code_checks.may_run(["tests"], "not slow")
    assert not code_checks.may_run(["tests/dist", "tests/unit/test_layout.py"], "")
