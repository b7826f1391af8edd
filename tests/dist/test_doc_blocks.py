"""Every code block of README.md and docs/*.md runs as written (tests/doc_blocks.py says
how blocks are read and marked): Python blocks in 2 gloo processes under torchrun, bash
blocks as commands in a copy of the repository with a virtual environment of its own,
excerpts checked against the files they quote. Blocks marked gpu-only run in
tests/gpu/test_doc_blocks_gpu.py instead."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import doc_blocks
from doc_blocks import REPO, Block, blocks, cpu_documents, documents
from shared_launches import batched, prefetched_in

pytestmark = pytest.mark.multiprocess
ALL = [b for p in documents() for b in blocks(p)]
CPU_BASH = [
    b
    for b in ALL
    if b.language == "bash" and b.runs and not b.gpu_only and "run-by" not in b.directives
]


def test_every_directive_is_known() -> None:
    assert [u for p in documents() for u in doc_blocks.unknown_directives(p)] == []


def test_every_python_and_bash_block_is_run_or_marked() -> None:
    """Code is run, on CPU or GPU; a block not run says why (skip) or what it quotes."""
    for b in ALL:
        if b.language:
            assert b.runs or b.directives.get("skip") or "excerpt" in b.directives, b.name


@pytest.mark.parametrize(
    "block", [b for b in ALL if "run-by" in b.directives], ids=lambda b: b.name
)
def test_a_block_run_by_a_test_module_is_read_by_it(block: Block) -> None:
    """The module a `run-by` block names takes its commands from the document (the module
    itself checks that it found them)."""
    module = REPO / block.directives["run-by"]
    assert block.language == "bash" and module.is_file(), block.name
    assert f'run_by("{block.directives["run-by"]}")' in module.read_text(), block.name


@pytest.mark.parametrize(
    "block", [b for b in ALL if "excerpt" in b.directives], ids=lambda b: b.name
)
def test_excerpts_are_lines_of_their_files(block: Block) -> None:
    assert doc_blocks.excerpt_problems(block) == []


# Every document's Python blocks, and the runner's own check, in the shared two-process
# launch, after its other scenarios (tests/scenarios/doc_python_blocks.py).
DOCUMENTS = cpu_documents()
LAUNCH = batched(
    "doc_python_blocks.py",
    [*(p.stem for p in DOCUMENTS), "runner"],
    nproc=2,
    timeout=600,
    last=True,
)


def _by_block(ranks: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """{block name: each rank's result} of one document's scenario; the scenario's own
    error where a rank has no block results."""
    if any("blocks" not in r for r in ranks):
        return {"(the document's run)": ranks}
    return {
        result["block"]: [r["blocks"][index] for r in ranks]
        for index, result in ranks[0]["blocks"].items()
    }


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return LAUNCH.results(tmp_path_factory)


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_python_blocks_run_on_two_cpu_processes(path: Path, launched: Any) -> None:
    results = _by_block(launched[path.stem])
    ran = [b.name for b in blocks(path) if b.language == "python" and b.runs and not b.gpu_only]
    assert sorted(results) == sorted(ran)
    assert doc_blocks.failures(results) == ""


def test_a_failing_block_and_a_gpu_only_block(launched: Any) -> None:
    """The runner reports a block that raises on one rank only, runs the blocks after it,
    and leaves gpu-only blocks to the GPU test."""
    results = _by_block(launched["runner"])
    assert [name.rsplit("/", 1)[-1] for name in results] == ["doc.md:1", "doc.md:14"]
    first, last = results.values()
    assert "error" not in first[0] and "AssertionError: not rank 0" in first[1]["error"]
    assert all("error" not in r for r in last)


def _scratch(root: Path) -> tuple[Path, dict[str, str]]:
    """A copy of the repository and a virtual environment that sees this one's packages
    (so `pip install -e .` installs the copy and fetches nothing it already has). The copy
    leaves out the virtual environment CI makes inside the checkout (.venv, 1.4 GB with
    PyTorch), which nothing run in the copy uses."""
    repo = root / "repo"
    shutil.copytree(
        REPO,
        repo,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "__pycache__", "*.egg-info", ".*_cache", "out"
        ),
    )
    venv = root / "venv"
    # No pip of its own: the outer one, which it sees, installs into it.
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300
    )
    [packages] = list((venv / "lib").glob("python*/site-packages"))
    (packages / "outer_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in {
            "PYTHONPATH",
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "VIRTUAL_ENV",
        }
    }
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        COLUMNS="100",
    )
    return repo, env


def _run_bash_blocks(root: Path) -> dict[str, str]:
    """What went wrong in each CPU bash block ("" if nothing), run in order in one copy."""
    repo, env = _scratch(root)
    return {block.name: doc_blocks.run_commands(block, repo, env) for block in CPU_BASH}


BASH_RUNS = prefetched_in("firstcontact", _run_bash_blocks)


@pytest.mark.parametrize("block", CPU_BASH, ids=lambda b: b.name)
def test_bash_blocks_run_as_typed(block: Block) -> None:
    assert BASH_RUNS.result()[block.name] == ""
