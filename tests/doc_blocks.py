"""The code blocks of README.md and docs/*.md, and running them as a user would.

What a block is, from its fence's language:

* ``python``: a script. Every Python block of a file runs, in order, each in a fresh
  namespace, the ranks meeting after each, in a folder of the file's own. On CPU
  (tests/dist) every file's blocks are scenarios of the suite's shared launch of 2 gloo
  processes (tests/scenarios/doc_python_blocks.py), after its other scenarios; on GPUs
  (tests/gpu) a file's blocks run in a launch of their own, one process per GPU over
  NCCL, as `python this_file.py --out DIR FILE.md` under torchrun. Blocks of later files
  see the processes the earlier ones left.
* ``bash`` / ``sh`` / ``shell``: commands a user types. Each command (lines joined at a
  trailing backslash; `#` comment lines skipped) runs in a copy of the repository, in a
  virtual environment of its own that sees the installed packages (so `pip install -e .`
  installs this copy and downloads nothing that is already there).
* anything else (no language, ``text``, ``json``, ``console``): output shown to the reader;
  not run.

An HTML comment on the line(s) just before a block changes that, one directive each:

* ``<!-- doc-test: gpu-only -->``: it needs a GPU; the CPU tests leave it out and
  tests/gpu/test_doc_blocks_gpu.py runs it.
* ``<!-- doc-test: skip REASON -->``: it is not run by the tests at all, for REASON
  (the whole test suite, for instance). Use sparingly; the reason is printed.
* ``<!-- doc-test: excerpt PATH -->``: it is an excerpt of PATH (relative to the
  repository): each of its lines, stripped of comments, must be a line of PATH.
* ``<!-- doc-test: run-by PATH -->``: a bash block the test module PATH runs as typed
  and checks the results of (`run_by`), so that the suite runs it once rather than twice.
* ``<!-- doc-test: setup`` ... ``-->`` (several lines): Python run before the block in
  its namespace: the objects a fragment refers to (a model, a loader).
  ``<!-- doc-test: file-setup`` ... ``-->`` anywhere in a file is run before each of its
  Python blocks (before the block's own setup).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import collector
from launcher import collect, torchrun_env

REPO = Path(__file__).resolve().parent.parent
CODE_LANGUAGES = {"python": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
DIRECTIVES = {"gpu-only", "skip", "excerpt", "setup", "file-setup", "run-by"}
_FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
_COMMENT = re.compile(r"<!--\s*doc-test:\s*([\w-]+)(.*?)-->", re.S)


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str  # "python", "bash", or "" for output
    code: str
    directives: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        where = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{where}:{self.line}"

    @property
    def gpu_only(self) -> bool:
        return "gpu-only" in self.directives

    @property
    def runs(self) -> bool:
        """Run at all (on CPU or on GPU): code, not an excerpt, not skipped."""
        return bool(self.language) and not ({"skip", "excerpt"} & set(self.directives))

    def commands(self) -> list[str]:
        """A bash block's commands: continuation lines joined, comments dropped."""
        commands, current = [], ""
        for raw in self.code.splitlines():
            line = raw.strip()
            if not current and (not line or line.startswith("#")):
                continue
            if line.endswith("\\"):
                current += line[:-1] + " "
                continue
            commands.append(current + line)
            current = ""
        return commands


def run_by(test_file: str) -> list[Block]:
    """The blocks whose `run-by` directive names `test_file` (relative to the repository),
    in the order of the documents."""
    return [b for p in documents() for b in blocks(p) if b.directives.get("run-by") == test_file]


def documents() -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def cpu_documents() -> list[Path]:
    """The documents with a Python block that runs on CPU."""
    return [
        p
        for p in documents()
        if any(b.language == "python" and b.runs and not b.gpu_only for b in blocks(p))
    ]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of `path` with the directives of the comments just before each."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        language = CODE_LANGUAGES.get(fence.group(1).lower(), "")
        found.append(
            Block(
                path,
                i + 1,
                language,
                "\n".join(lines[i + 1 : end]) + "\n",
                _directives_before(lines, i),
            )
        )
        i = end + 1
    return found


def _directives_before(lines: list[str], fence: int) -> dict[str, str]:
    """The doc-test comments that end on the lines right above line `fence`."""
    before = "\n".join(lines[:fence])
    found: dict[str, str] = {}
    while True:
        before = before.rstrip(" \t")
        before = before[:-1] if before.endswith("\n") else before
        start = before.rfind("<!--")
        match = (
            _COMMENT.fullmatch(before[start:]) if before.endswith("-->") and start >= 0 else None
        )
        if match is None:
            return found
        if match.group(1) != "file-setup":
            found[match.group(1)] = match.group(2).strip("\n ")
        before = before[:start]


def file_setup(path: Path) -> str:
    return "\n".join(
        m.group(2).strip("\n")
        for m in _COMMENT.finditer(path.read_text())
        if m.group(1) == "file-setup"
    )


def unknown_directives(path: Path) -> list[str]:
    return [
        f"{path.name}: unknown directive `doc-test: {m.group(1)}`"
        for m in _COMMENT.finditer(path.read_text())
        if m.group(1) not in DIRECTIVES
    ]


def python_source(block: Block) -> str:
    """What runs for a Python block: the file's setup, the block's setup, the block."""
    return "\n".join([file_setup(block.path), block.directives.get("setup", ""), block.code])


def excerpt_problems(block: Block) -> list[str]:
    """Lines of an excerpt block that are not lines of the file it quotes."""
    source = REPO / block.directives["excerpt"]
    if not source.exists():
        return [f"{block.name}: {source} does not exist"]
    have = {_without_comment(line) for line in source.read_text().splitlines()}
    return [
        f"{block.name}: `{line.strip()}` is not in {block.directives['excerpt']}"
        for line in block.code.splitlines()
        if _without_comment(line) and _without_comment(line) not in have
    ]


def _without_comment(line: str) -> str:
    return line.split("  #")[0].split("# ")[0].strip() if "#" in line else line.strip()


def launch_python_blocks(
    path: Path, out: Path, nproc: int, gpu: bool, timeout: float = 600
) -> dict[str, list[dict[str, Any]]]:
    """Launch the file's Python blocks under torchrun; {block name: per-rank results},
    a result with "error" for a block that failed, or never reported, on that rank."""
    return launch_documents([path], out, nproc, gpu, timeout)[path]


def launch_documents(
    paths: list[Path], out: Path, nproc: int, gpu: bool, timeout: float = 600
) -> dict[Path, dict[str, list[dict[str, Any]]]]:
    """The Python blocks of every file of `paths`, in one torchrun launch (a launch costs
    each process a PyTorch import): {path: {block name: per-rank results}}. Each file runs
    in a folder of its own, out/0, out/1, ..., in the order given."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(REPO / "tests" / "doc_blocks.py"),
        "--out",
        str(out),
        *(["--gpu"] if gpu else []),
        *[str(p) for p in paths],
    ]
    env = torchrun_env()
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    try:
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as err:
        raw = err.stderr or ""
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        done = subprocess.CompletedProcess(cmd, -1, "", f"{text}\n(stopped after {timeout} s)")
    found: dict[Path, dict[str, list[dict[str, Any]]]] = {}
    for number, path in enumerate(paths):
        chosen = {
            str(index): block.name
            for index, block in enumerate(
                b for b in blocks(path) if b.language == "python" and b.runs
            )
            if gpu or not block.gpu_only
        }
        ranks_of = collect(_document_out(out, number), list(chosen), nproc, done)
        found[path] = {chosen[k]: ranks for k, ranks in ranks_of.items()}
    return found


def _document_out(out: Path, number: int) -> Path:
    return out / str(number)


def failures(results: dict[str, list[dict[str, Any]]]) -> str:
    """The errors of the blocks that failed on some rank, one after the other ("" if none)."""
    return "\n\n".join(
        f"{name}:\n{r['error']}" for name, ranks in results.items() for r in ranks if "error" in r
    )


def run_commands(block: Block, cwd: Path, env: dict[str, str], timeout: float = 900) -> str:
    """Run a bash block's commands in `cwd`; what went wrong ("" if nothing)."""
    for command in block.commands():
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            return (
                f"{block.name}: `{command}` exited {done.returncode}\n{done.stdout[-3000:]}\n"
                f"{done.stderr[-3000:]}"
            )
    return ""


def run_python_blocks(path: Path, out: Path, gpu: bool) -> None:
    """Inside a torchrun worker: run the file's Python blocks in order, one result file
    each (`block_results`)."""
    rank = int(os.environ.get("RANK", "0"))
    for index, result in block_results(path, gpu).items():
        (out / f"{index}.rank{rank}.json").write_text(json.dumps(result))


def block_results(path: Path, gpu: bool) -> dict[str, dict[str, object]]:
    """Inside a torchrun worker: run the file's Python blocks in order, each in a fresh
    namespace, the ranks meeting after each; {block's index among the file's Python
    blocks: {"block": its name, "error": the traceback if it raised}}."""
    import torch.distributed as dist

    import ddpgraph

    ddpgraph.init_distributed()
    collector.tune()
    found: dict[str, dict[str, object]] = {}
    for index, block in enumerate(b for b in blocks(path) if b.language == "python" and b.runs):
        if block.gpu_only and not gpu:
            continue
        result: dict[str, object] = {"block": block.name}
        namespace: dict[str, object] = {"__name__": "__main__"}
        try:
            exec(compile(python_source(block), block.name, "exec"), namespace)
        except BaseException:  # a block's SystemExit is a failure too
            result["error"] = traceback.format_exc()
        _close_steps(namespace)
        found[str(index)] = result
        if dist.is_initialized():
            dist.barrier()
    return found


def _close_steps(namespace: dict[str, object]) -> None:
    """Free the graphs a block left open (a live graph holds the NCCL communicator)."""
    for value in namespace.values():
        close = getattr(value, "close", None)
        if type(value).__module__.startswith("ddpgraph") and callable(close):
            close()
    namespace.clear()
    collector.settle()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gpu", action="store_true", help="also run the gpu-only blocks")
    parser.add_argument("documents", type=Path, nargs="+")
    args = parser.parse_args()
    for number, document in enumerate(args.documents):
        out = _document_out(args.out, number).resolve()
        out.mkdir(parents=True, exist_ok=True)
        os.chdir(out)  # files a block writes (checkpoints) land here, a folder per file
        run_python_blocks(document.resolve(), out, args.gpu)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
