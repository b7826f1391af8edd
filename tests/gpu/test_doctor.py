"""`ddpgraph doctor` on 2 GPUs: each example script in tests/doctor_scripts/ with one
mistake gets exactly one finding, with the right code, ranks and line (the script's
`# doctor:` comment); the correct scripts come back clean. Each script also runs under
plain torchrun and fails (or silently succeeds) the same way without the doctor.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from doctor_scripts.expect import env, marked, run_doctor, run_plain, summary
from launcher import gpu_world

pytestmark = pytest.mark.gpu
WORLD = gpu_world()
BOTH = list(range(WORLD))  # every rank

# script -> (code, ranks it must be reported on, whether the plain run fails)
FAILING = {
    "stream_mismatch.py": ("DDP_STREAM_MISMATCH", BOTH, True),
    "warmup_short.py": ("WARMUP_TOO_SHORT", BOTH, True),
    "item_in_capture.py": ("HOST_SYNC_IN_CAPTURE", BOTH, True),
    "optimizer_not_capturable.py": ("OPTIMIZER_NOT_CAPTURABLE", BOTH, True),
    "grad_scaler.py": ("GRAD_SCALER_IN_CAPTURE", BOTH, True),
    "static_input_shape.py": ("STATIC_INPUT_CHANGED", BOTH, True),
    "lr_baked.py": ("LR_BAKED_INTO_GRAPH", BOTH, False),
    "state_replaced.py": ("OPTIMIZER_STATE_REPLACED", BOTH, False),
    "static_input_unwritten.py": ("STATIC_INPUT_CHANGED", BOTH, False),
    "ranks_disagree.py": ("CAPTURE_RANKS_DISAGREE", [1], False),
}
CLEAN = ["clean_recipe.py", "clean_capture_step.py"]
# Scripts whose mistake is between ranks: with one rank there is none to find.
TWO_RANKS = {"ranks_disagree.py"}


def _scripts(names: list[str]) -> list[object]:
    return [pytest.param(n, marks=pytest.mark.two_ranks) if n in TWO_RANKS else n for n in names]


@pytest.mark.parametrize("name", _scripts(sorted(FAILING)))
def test_one_finding_with_code_ranks_and_line(name: str) -> None:
    code, ranks, _ = FAILING[name]
    status, report, output = run_doctor(name, nproc=WORLD)
    assert status == 1, output[-4000:]
    line = marked(name)[code][None]
    assert summary(report) == [(code, ranks, line)], json.dumps(report["findings"], indent=1) + output[-4000:]
    assert report["findings"][0]["location"]["file"].endswith(name)
    assert all(r["doctor_errors"] == [] for r in report["ranks"]), report["ranks"]


@pytest.mark.parametrize("name", CLEAN)
def test_correct_scripts_come_back_clean(name: str) -> None:
    status, report, output = run_doctor(name, nproc=WORLD)
    assert status == 0, json.dumps(report["findings"], indent=1) + output[-4000:]
    assert report["findings"] == []
    assert all(r["status"] == "finished" and r["ddp_captures"] == 1 and r["ddp_replays"] >= 10 for r in report["ranks"]), report["ranks"]
    assert all(r["doctor_errors"] == [] for r in report["ranks"]), report["ranks"]


@pytest.mark.parametrize("name", _scripts(sorted(FAILING) + CLEAN))
def test_scripts_behave_the_same_without_the_doctor(name: str) -> None:
    fails = FAILING[name][2] if name in FAILING else False
    done = run_plain(name, nproc=WORLD)
    assert (done.returncode != 0) == fails, done.stderr[-4000:]
    if fails:
        expected = "size of tensor" if name == "static_input_shape.py" else "captur"
        assert expected in done.stderr, done.stderr[-4000:]


def test_env_on_the_gpu_machine() -> None:
    done = subprocess.run([sys.executable, "-m", "ddpgraph", "doctor", "--env", "--json"],
                          env=env(), capture_output=True, text=True, timeout=120, check=False)
    data = json.loads(done.stdout)
    assert done.returncode == (1 if data["findings"] else 0)
    assert len(data["gpus"]) >= WORLD and data["versions"]["nccl"]
    features = {f["name"]: f["available"] for f in data["features"]}
    assert features["CUDA graphs"] and features["NCCL collectives inside graphs"]
