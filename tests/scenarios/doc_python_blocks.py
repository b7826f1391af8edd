"""The Python blocks of README.md and docs/*.md, as scenarios of the shared two-process
launch on CPU (tests/shared_launches.py `batched`): a document's blocks run in order,
each in a fresh namespace, the ranks meeting after each, in a folder of the document's
own (what a block writes lands there), as tests/doc_blocks.py runs them in a launch of
their own on the GPUs. The launch's processes have imported PyTorch and the libraries
the blocks use already, which a launch of their own would import again; the blocks run
after every other scenario of the launch, so that what they leave reaches none of those;
what those leave in process-wide state that a block's library reads (Accelerate's
singletons) is reset before each document, as a new process would have it.

`runner` checks the runner itself: a block that raises on one rank only, a gpu-only
block (left out on CPU), a setup.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness

from doc_blocks import block_results, cpu_documents

RUNNER_DOC = (
    "```python\nimport torch.distributed as dist\n"
    "assert dist.get_rank() == 0, 'not rank 0'\n```\n\n"
    "<!-- doc-test: gpu-only -->\n```python\nraise SystemExit(3)\n```\n\n"
    "<!-- doc-test: setup\nvalue = 41\n-->\n```python\nassert value + 1 == 42\n```\n"
)


def _as_in_a_new_process() -> None:
    """Accelerate's state as a new process has it: the launch's Accelerate scenarios set
    its process-wide singletons (mixed precision, among others), and an `Accelerator` made
    with other settings is refused while they hold. The process group stays."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=False)
        state.GradientState._reset_state()


def _in_its_folder(name: str, document: Callable[[Path], Path]) -> harness.Scenario:
    """The blocks of `document(folder)`, run in `folder`, a new folder of the launch's."""

    def run(info: Any) -> dict[str, Any]:
        folder = Path(harness.out_dir()) / f"doc_{name}"
        folder.mkdir(parents=True, exist_ok=True)
        here = os.getcwd()
        os.chdir(folder)
        _as_in_a_new_process()
        try:
            return {"blocks": block_results(document(folder), gpu=False)}
        finally:
            os.chdir(here)

    return run


def _runner_document(folder: Path) -> Path:
    path = folder / "doc.md"
    path.write_text(RUNNER_DOC)
    return path


REGISTRY: dict[str, harness.Scenario] = {
    **{p.stem: _in_its_folder(p.stem, lambda _, p=p: p) for p in cpu_documents()},
    "runner": _in_its_folder("runner", _runner_document),
}

if __name__ == "__main__":
    harness.run(REGISTRY)
