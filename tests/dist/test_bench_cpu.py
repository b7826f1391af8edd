"""`ddpgraph bench` end to end on two CPU processes (gloo): the plain command launches
its own torchrun workers, which run the eager strategies on tiny models from a factory
module, record a failure in words, and write the table, the JSON and the plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpgraph.bench import validate
from launcher import torchrun_env
from shared_launches import prefetched_in

pytestmark = pytest.mark.multiprocess

ARGS = [
    "--model",
    "bench_models:tiny,bench_models:broken,bench_models:flaky",
    "--batch-sizes",
    "tiny=4,8",
    "broken=4",
    "flaky=4",
    "--steps",
    "6",
    "--warmup",
    "12",
    "--loader-workers",
    "1",
    "--nproc=2",  # as a user types it: it must not reach torchrun's own parser
]


def _run_bench(out: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]:
    cmd = [
        sys.executable,
        "-m",
        "ddpgraph",
        "bench",
        *ARGS,
        "--json",
        "bench.json",
        "--plot",
        "bench.png",
    ]
    proc = subprocess.run(
        cmd, cwd=out, env=torchrun_env(), capture_output=True, text=True, timeout=300, check=False
    )
    (out / "bench.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads((out / "bench.json").read_text()), out


# Run in the background while other tests run (tests/shared_launches.py).
BENCH = prefetched_in("bench", _run_bench)


@pytest.fixture(scope="module")
def run() -> tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]:
    return BENCH.result()


def _results(data: dict[str, Any]) -> dict[tuple[str, int, str], dict[str, Any]]:
    return {(r["model"], r["batch_size"], r["strategy"]): r for r in data["results"]}


def test_json_follows_the_schema_and_records_the_setup(run: Any) -> None:
    _, data, _ = run
    assert validate(data) == []
    setup = data["setup"]
    assert (setup["world_size"], setup["backend"], setup["device"] is not None) == (2, "gloo", True)
    assert setup["cuda"] is None and setup["nccl"] is None
    assert setup["command"].startswith("ddpgraph bench --model bench_models:tiny")
    assert setup["settings"]["batch_sizes"] == {"tiny": [4, 8], "broken": [4], "flaky": [4]}
    assert [s["name"] for s in data["strategies"]][-1] == "partial"


def test_eager_strategies_run_and_train_identically(run: Any) -> None:
    _, data, _ = run
    results = _results(data)
    for batch_size in (4, 8):
        eager = results[("tiny", batch_size, "eager")]
        captured = results[("tiny", batch_size, "whole")]
        for r in (eager, captured):
            assert r["status"] == "ok", r["reason"]
            assert set(r["feeds"]) == {"device", "dataloader"}
            assert len(r["feeds"]["device"]["window_ms"]) == 1  # 6 steps: one window
            assert r["feeds"]["dataloader"]["ms_per_step"] > 0
        assert eager["feeds"]["device"]["speedup"] == pytest.approx(1.0)
        assert captured["feeds"]["device"]["speedup"] > 0
        # The emulated capture trains with the fused CPU AdamW, which rounds differently
        # from eager's default one: the same math, not the same bits.
        assert captured["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-5)
        assert (
            captured["note"].startswith("CPU emulation")
            and "not a GPU speed-up" in captured["note"]
        )
    assert [row["batch_size"] for row in data["summary"]] == [4, 8]


def test_gpu_strategies_are_skipped_with_a_reason(run: Any) -> None:
    _, data, _ = run
    results = _results(data)
    for name in ("torch-compile", "reduce-overhead", "recipe", "compile", "partial"):
        r = results[("tiny", 4, name)]
        assert r["status"] == "skipped" and r["reason"], name


def test_failures_are_recorded_and_the_run_goes_on(run: Any) -> None:
    _, data, _ = run
    results = _results(data)
    for name in ("eager", "whole"):
        broken = results[("broken", 4, name)]
        assert broken["status"] == "failed"
        assert broken["reason"] == (
            "failed during warm-up (ranks 0-1: RuntimeError: this model cannot run forward)"
        )
        flaky = results[("flaky", 4, name)]
        assert flaky["status"] == "failed"
        assert flaky["reason"] == (
            "failed during model (rank 1: MemoryError: no memory for the model on this rank)"
        )


def test_table_and_plot(run: Any) -> None:
    proc, data, out = run
    assert "tiny: 2 × " in proc.stdout
    assert "whole against the others" in proc.stdout
    assert "Strategies: eager = DDP as written; whole = capture_step." in proc.stdout
    assert "Results written to bench.json" in proc.stdout
    assert "tiny batch 8 whole:" in proc.stderr  # a progress line per result
    assert "| 4 | eager |" in data["markdown"]
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
