"""`ddpgraph doctor` on the GPUs (one per rank; `DDPGRAPH_GPU_WORLD` of them, 2 unless
set): every example script in tests/doctor_scripts/ gets exactly the findings its
`# doctor:` comments mark (code, ranks, line), and the scripts without marks come back
clean. The scripts that need two ranks for their expectation skip at world size 1. Each
script also runs under plain torchrun and fails (or silently succeeds) the same way
without the doctor.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest

from doctor_scripts.expect import (
    all_scripts,
    doctor_timeout,
    env,
    expectations,
    ranks_needed,
    run_doctor,
    run_plain,
)
from doctor_scripts.score import score_report
from launcher import gpu_world

pytestmark = pytest.mark.gpu
WORLD = gpu_world()

# The scripts whose plain run fails, and a text its error output shows.
PLAIN_FAILS = {
    "stream_mismatch.py": "captur",
    "warmup_short.py": "captur",
    "item_in_capture.py": "captur",
    "optimizer_not_capturable.py": "captur",
    "grad_scaler.py": "captur",
    "static_input_shape.py": "size of tensor",
    "own_stream_item_logging.py": "captur",
    "own_stream_default_adam.py": "capturable",
    "slice_assign_short_batch.py": "size",
    "metrics_window_copy.py": "size of tensor",
    "capture_step_batch_object.py": "UNSUPPORTED_INPUT",
    "cpu_fail.py": "batch_size",
    "cpu_nan_monitor.py": "NON_FINITE_LOSS",
    "recipe_pinned_loader.py": "captur",
}
# Long-running or hanging without a time limit: not run plainly.
NOT_PLAIN = {"cpu_hang.py"}


def _run(name: str) -> tuple[int, dict, str]:
    if ranks_needed(name) > WORLD:
        pytest.skip(f"its expectation needs {ranks_needed(name)} ranks; DDPGRAPH_GPU_WORLD={WORLD}")
    return _doctored(name)


@functools.cache
def _doctored(name: str) -> tuple[int, dict, str]:
    """The doctor's run of `name`, once per session: the tests of one script share it."""
    return run_doctor(name, nproc=WORLD, timeout=doctor_timeout(name))


@pytest.mark.parametrize("name", all_scripts())
def test_findings_are_exactly_the_marked_ones(name: str) -> None:
    status, report, output = _run(name)
    expected = expectations(name, gpu=True)
    score = score_report(name, report, expected, WORLD)
    shown = json.dumps(report["findings"], indent=1) + output[-4000:]
    assert (score.wrong, score.missed) == (0, 0), shown
    assert len(report["findings"]) == len(expected), shown
    assert status == (1 if expected else 0), shown
    assert all(r["doctor_errors"] == [] for r in report["ranks"]), report["ranks"]


def test_pytorchs_recipe_on_the_graphs_own_stream_captures_clean() -> None:
    # DDP built under `torch.cuda.stream(s)`, captured with `torch.cuda.graph(g)`: PyTorch
    # warns that the accumulators' stream differs, and the capture is fine.
    status, report, output = _run("own_stream_clean.py")
    assert status == 0 and report["findings"] == [], output[-4000:]
    assert all(r["ddp_captures"] == 1 and r["ddp_replays"] == 20 for r in report["ranks"]), report[
        "ranks"
    ]


def test_an_odd_batch_on_one_rank_is_no_disagreement() -> None:
    if WORLD < 2:
        pytest.skip("the odd batch falls on one rank of two; DDPGRAPH_GPU_WORLD=1")
    status, report, output = _run("capture_step_uneven_shards.py")
    assert status == 0 and report["findings"] == [], (
        json.dumps(report["findings"], indent=1) + output[-4000:]
    )
    ranks = report["ranks"]
    # The case did happen: the last rank replayed less, and synchronised as often.
    assert ranks[0]["ddp_replays"] > ranks[-1]["ddp_replays"], ranks
    assert len({r["collective_steps"] for r in ranks}) == 1, ranks


def test_a_pinned_dataloader_is_named_by_its_pin_memory_thread() -> None:
    # The recipe in CUDA's global mode, fed by DataLoader(num_workers=4, pin_memory=True):
    # the pin-memory thread, its DataLoader's line and the fix; with the fix, clean.
    name = "recipe_pinned_loader.py"
    _, report, output = _run(name)
    # Whether the pinning falls inside the capture is a race (on a loaded machine the
    # worker may hand the next batch over only after it): a clean capture is run again,
    # at most twice; any finding is judged at once.
    for _ in range(2):
        if report["findings"]:
            break
        _, report, output = run_doctor(
            "recipe_pinned_loader.py",
            nproc=WORLD,
            timeout=doctor_timeout("recipe_pinned_loader.py"),
        )
    [finding] = report["findings"]
    assert finding["code"] == "OTHER_THREAD_IN_CAPTURE", output[-4000:]
    assert "pin-memory thread of the DataLoader built at " in finding["happened"]
    assert (
        "loader = DataLoader(" in finding["happened"]
        and "`Tensor.pin_memory`" in finding["happened"]
    )
    assert (
        'capture_error_mode="thread_local"' in finding["fix"] and "capture_step" in finding["fix"]
    )
    for clean in ("recipe_pinned_loader_thread_local.py", "capture_step_pinned_loader.py"):
        status, report, output = _run(clean)
        assert status == 0 and report["findings"] == [], (
            json.dumps(report["findings"], indent=1) + output[-4000:]
        )
        assert all(r["captures"] == 1 and r["replays"] > 40 for r in report["ranks"]), report[
            "ranks"
        ]


def test_a_sync_inside_transformers_names_the_chain_and_a_setting() -> None:
    _, report, output = _run("hf_llama_eager_attention.py")
    [finding] = report["findings"]
    assert finding["code"] == "HOST_SYNC_IN_CAPTURE", output[-4000:]
    assert finding["location"]["source"].startswith("return self.lm(input_ids=ids).logits")
    assert (
        "calls into transformers, where" in finding["happened"]
        and "transformers/" in finding["happened"]
    )
    assert 'attn_implementation="sdpa"' in finding["fix"]
    assert "calls into transformers" in output  # the script prints step.reason: the same chain


@pytest.mark.parametrize("name", sorted(set(all_scripts()) - NOT_PLAIN))
def test_scripts_behave_the_same_without_the_doctor(name: str) -> None:
    if ranks_needed(name) > WORLD:
        pytest.skip(f"needs {ranks_needed(name)} ranks")
    done = run_plain(name, nproc=WORLD)
    fails = name in PLAIN_FAILS
    assert (done.returncode != 0) == fails, done.stderr[-4000:]
    if fails:
        assert PLAIN_FAILS[name] in done.stderr, done.stderr[-4000:]


def test_env_on_the_gpu_machine() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ddpgraph", "doctor", "--env", "--json"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    data = json.loads(done.stdout)
    assert done.returncode == (1 if data["findings"] else 0)
    assert len(data["gpus"]) >= WORLD and data["versions"]["nccl"]
    features = {f["name"]: f["available"] for f in data["features"]}
    assert features["CUDA graphs"] and features["NCCL collectives inside graphs"]
