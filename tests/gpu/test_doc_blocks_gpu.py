"""The code blocks of README.md and docs/*.md on GPUs: every Python block (those marked
gpu-only among them) in one process per GPU over NCCL, and the bash blocks marked gpu-only
as commands. tests/doc_blocks.py says how blocks are read and marked; the CPU test of
the same blocks is tests/dist/test_doc_blocks.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import doc_blocks
from doc_blocks import REPO, Block, blocks, documents
from launcher import gpu_world

pytestmark = pytest.mark.gpu
PYTHON_FILES = [p for p in documents() if any(b.language == "python" and b.runs for b in blocks(p))]
GPU_BASH = [
    b for p in documents() for b in blocks(p) if b.language == "bash" and b.runs and b.gpu_only
]


@pytest.mark.parametrize("path", PYTHON_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_python_blocks_run_on_the_gpus(path: Path, tmp_path: Path) -> None:
    results = doc_blocks.launch_python_blocks(
        path, tmp_path, nproc=gpu_world(), gpu=True, timeout=480
    )
    assert doc_blocks.failures(results) == ""


@pytest.mark.parametrize("block", GPU_BASH, ids=lambda b: b.name)
def test_gpu_only_commands_run(block: Block, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK"}}
    assert doc_blocks.run_commands(block, tmp_path, env, timeout=480) == ""
