"""The GPU suite's selection logic and its summaries, checked on CPU: which GPU tests run
at which world size, the stages of scripts/gpu_suite.sh, and a summary of a stage that
ran out of time."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import launcher
from launcher import gpu_skip_reason, scenarios_for_world

REPO = Path(__file__).parents[2]
SUITE = REPO / "scripts" / "gpu_suite.sh"


@pytest.mark.parametrize(
    ("env", "gpus", "world"),
    [(None, 0, 2), (None, 1, 1), (None, 2, 2), (None, 8, 2), ("1", 2, 1), ("4", 2, 4)],
)
def test_world_size_follows_the_gpus_present(
    monkeypatch: pytest.MonkeyPatch, env: str | None, gpus: int, world: int
) -> None:
    if env is None:
        monkeypatch.delenv("DDPGRAPH_GPU_WORLD", raising=False)
    else:
        monkeypatch.setenv("DDPGRAPH_GPU_WORLD", env)
    monkeypatch.setattr(launcher, "gpu_count", lambda: gpus)
    assert launcher.gpu_world() == world


def test_skip_reasons() -> None:
    assert gpu_skip_reason(two_ranks=False, world=2, found=0) == "needs 2 CUDA GPUs, found 0"
    assert gpu_skip_reason(two_ranks=True, world=2, found=1) == "needs 2 CUDA GPUs, found 1"
    assert gpu_skip_reason(two_ranks=True, world=1, found=1) == launcher.TWO_RANKS_REASON
    assert gpu_skip_reason(two_ranks=False, world=1, found=1) is None
    assert gpu_skip_reason(two_ranks=True, world=2, found=2) is None


def test_scenarios_read_only_by_two_rank_tests_are_not_launched_on_one_rank() -> None:
    names = ["a", "b", "c"]
    assert scenarios_for_world(names, {"b"}, world=1) == ["a", "c"]
    assert scenarios_for_world(names, {"b"}, world=2) == names
    with pytest.raises(ValueError, match="not among the scenarios"):
        scenarios_for_world(names, {"z"}, world=1)


def _two_rank_tests(path: Path) -> dict[str, bool]:
    """{test name: marked two_ranks} for each test function of a GPU test file."""
    tree = ast.parse(path.read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            found[node.name] = any("two_ranks" in ast.unparse(d) for d in node.decorator_list)
    return found


def test_tests_that_compare_two_ranks_are_marked() -> None:
    """The tests whose bodies read a second rank's result or a fixed rank pair."""
    pair = re.compile(r"\[0, 1\]|rank1|ranks\[1\]")
    for path in sorted((REPO / "tests" / "gpu").glob("test_*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        marks = _two_rank_tests(path)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and pair.search(ast.unparse(node)):
                assert marks[node.name], (
                    f"{path.name}::{node.name} compares two ranks but is not marked"
                )


def _stages() -> dict[str, str]:
    text = SUITE.read_text()
    block = text[text.index("declare -A TESTS=(") : text.index(")\ndeclare -A LIMIT")]
    return dict(re.findall(r"\[([\w-]+)\]=(\S+)", block))


def test_every_gpu_test_file_has_a_stage_with_a_limit_under_one_call() -> None:
    stages = _stages()
    files = {str(p.relative_to(REPO)) for p in (REPO / "tests" / "gpu").glob("test_*.py")}
    staged = {v.split("::")[0] for v in stages.values()}
    assert files <= staged, files - staged
    limits = dict(
        re.findall(r"\[([\w-]+)\]=(\d+)", SUITE.read_text().split("declare -A LIMIT=(")[1])
    )
    for stage in [*stages, "demo", "bench"]:
        if stage != "tests":  # all test files in one run: for machines with time to spare
            assert int(limits[stage]) <= 560, stage  # a call is 600 s, with setup before


def test_unknown_stage_is_refused_before_anything_runs(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(SUITE), "tests-everything"],
        cwd=REPO,
        env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "unknown stage 'tests-everything'" in done.stderr
    assert list(tmp_path.iterdir()) == []


def _summary(tmp_path: Path, stage: str, rc: int) -> str:
    debug, out = tmp_path / "debug", tmp_path / "out"
    debug.mkdir(exist_ok=True)
    out.mkdir(exist_ok=True)
    (debug / "env.txt").write_text("torch 2.11.0+cu130\nworld size 1\n")
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "gpu_summary.py"),
            "--stage",
            stage,
            "--debug",
            str(debug),
            "--out",
            str(out),
            "--rc",
            str(rc),
            "--seconds",
            "541",
            "--limit",
            "540",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


JUNIT = (
    '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"\n'
    'failures="1" skipped="1" tests="3" time="530.1"><testcase '
    'classname="tests.gpu.test_core_gpu" name="test_a"\n'
    'time="1"/><testcase classname="tests.gpu.test_core_gpu" name="test_b" time="1"><failure '
    'message="x"/></testcase>\n'
    '<testcase classname="tests.gpu.test_core_gpu" name="test_c" time="0"><skipped '
    'message="compares two ranks"/>\n'
    "</testcase></testsuite></testsuites>"
)


def test_summary_of_a_test_stage_stopped_by_its_limit(tmp_path: Path) -> None:
    (tmp_path / "debug").mkdir()
    (tmp_path / "debug" / "tests-core.xml").write_text(JUNIT)
    text = _summary(tmp_path, "tests-core", 124)
    assert "# GPU run, tests-core" in text and "world size 1" in text
    assert "**tests-core: stopped by its time limit** after 541 s (limit 540 s)" in text
    assert "GPU tests: 1 passed, 1 failed, 0 errors, 1 skipped (of 3)" in text
    assert "| test_core_gpu::test_b | FAIL |" in text


def test_summary_without_any_report(tmp_path: Path) -> None:
    assert "no junit report" in _summary(tmp_path, "tests-doctor", 137)
    assert "Demo: no results" in _summary(tmp_path, "demo", 124)
    assert "Benchmark: no results" in _summary(tmp_path, "bench", 0)
    assert "bench: finished in 541 s (limit 540 s), exit status 0." in _summary(
        tmp_path, "bench", 0
    )
