"""The `ddpgraph` command's launching process never imports PyTorch (nor transformers,
lightning, matplotlib): `--help`, `--version`, usage errors, and the launch of `demo`,
`bench` and `doctor`, with the doctor's report after its workers end.

All of it runs in one child process where importing any of them raises ImportError
(`sys.modules[name] = None`) and no GPU is visible (`CUDA_VISIBLE_DEVICES=""`, so that
`ddp.process` knows without torch that there is none). Starting torchrun is stubbed: the
stub records the command line and stands for a torchrun that exited with status 1 before
any worker wrote a record, as one that failed to start does. Only the workers, which run
the same command under torchrun, import torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).parents[1] / "doctor_scripts" / "cpu_clean.py"

CHILD = r"""
import contextlib, io, json, subprocess, sys

for name in ("torch", "transformers", "lightning", "matplotlib"):
    sys.modules[name] = None  # `import name` raises ImportError


class Finished:
    # torchrun, ended with status 1 before any worker started.
    pid = 0
    returncode = 1

    def __init__(self, args, **kwargs):
        launched.append(list(args))

    def wait(self, timeout=None):
        return self.returncode


launched = []
subprocess.Popen = Finished
from ddpgraph.app import cli

results = []
for argv in json.loads(sys.argv[1]):
    launched.clear()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as stop:
            code = stop.code
        except Exception as error:
            code = f"{type(error).__name__}: {error}"
    results.append([code, out.getvalue(), err.getvalue(), list(launched)])
print(json.dumps(results))
"""

CASES: list[tuple[list[str], int]] = [
    (["--help"], 0),
    (["--version"], 0),
    ([], 2),
    (["demo", "--help"], 0),
    (["bench", "--help"], 0),
    (["doctor", "--help"], 0),
    (["demo", "--steps", "many"], 2),
    (["demo", "--batch", "0"], 2),
    (["bench", "--warmup", "3"], 2),
    (["bench", "--seq-lens", "64:512", "--model", "resnet18"], 2),
    (["bench", "--model", "gpt", "--strategies", "eager,nope"], 2),
    (["doctor", "no_such_script.py"], 2),
    (["demo", "--nproc", "2", "--steps", "4"], 1),
    (["bench", "--nproc", "2", "--model", "gpt,mlp", "--strategies", "eager,whole"], 1),
    (["bench", "--seq-lens", "8:32"], 1),
    (["doctor", "--json", "--nproc", "2", str(SCRIPT), "--steps", "3"], 1),
    (["doctor", "--nproc", "2", str(SCRIPT)], 1),
]


def torchrun(nproc: int, *args: str) -> list[str]:
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*run, f"--nproc_per_node={nproc}", "-m", *args]


@pytest.fixture(scope="module")
def results() -> dict[str, list[Any]]:
    if not sys.platform.startswith("linux"):
        pytest.skip("knowing there is no GPU without torch is for Linux only (ddp.process)")
    # Outside torchrun, as a user's shell would be, and with no GPU to see.
    outside = {"RANK", "WORLD_SIZE", "LOCAL_RANK"}
    env = {k: v for k, v in os.environ.items() if k not in outside} | {"CUDA_VISIBLE_DEVICES": ""}
    child = [sys.executable, "-c", CHILD, json.dumps([argv for argv, _ in CASES])]
    done = subprocess.run(child, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return {
        " ".join(argv): result
        for (argv, _), result in zip(CASES, json.loads(done.stdout), strict=True)
    }


@pytest.mark.parametrize(("argv", "code"), CASES, ids=[" ".join(a) or "(none)" for a, _ in CASES])
def test_the_launching_process_runs_without_torch(
    results: dict[str, list[Any]], argv: list[str], code: int
) -> None:
    got, out, err, launched = results[" ".join(argv)]
    assert got == code, (got, out, err)
    if code == 2 and argv[1:2] != ["--steps"] and argv:
        assert err.startswith("[INVALID_ARGUMENT] ") and "HINT:" in err, err
    if code != 1:
        assert launched == [], launched
    if argv in (["--help"], ["--version"], []):
        assert out.startswith(("usage: ddpgraph", "ddpgraph 0")), out


def test_demo_and_bench_start_torchrun_with_their_arguments(
    results: dict[str, list[Any]],
) -> None:
    assert results["demo --nproc 2 --steps 4"][3] == [
        torchrun(2, "ddpgraph", "demo", "--steps", "4")
    ]
    bench = "bench --nproc 2 --model gpt,mlp --strategies eager,whole"
    assert results[bench][3] == [
        torchrun(2, "ddpgraph", "bench", "--model", "gpt,mlp", "--strategies", "eager,whole")
    ]
    assert results["bench --seq-lens 8:32"][3] == [
        torchrun(2, "ddpgraph", "bench", "--seq-lens", "8:32")
    ]


def test_the_doctor_reports_a_torchrun_that_started_no_worker(
    results: dict[str, list[Any]],
) -> None:
    _, out, _, launched = results[f"doctor --json --nproc 2 {SCRIPT} --steps 3"]
    assert launched == [torchrun(2, "ddpgraph.doctor.worker", str(SCRIPT), "--steps", "3")]
    report = json.loads(out)
    assert (report["status"], report["exit_code"], report["torchrun_exit_code"]) == (
        "findings",
        1,
        1,
    )
    assert [f["code"] for f in report["findings"]] == ["SCRIPT_FAILED"]
    assert "torchrun exited with status 1" in report["findings"][0]["happened"]
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    _, out, _, _ = results[f"doctor --nproc 2 {SCRIPT}"]
    assert "SCRIPT_FAILED" in out and "missing" in out and out.endswith("1 finding.\n"), out
