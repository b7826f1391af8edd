"""`ddpgraph bench --seq-lens` on GPUs, as a user types it: on the demo GPT the bucketed
row holds a graph per bucket, replays every timed step and reports its pool against the
largest bucket's; on a small language model every row runs, the compiled ones included.
Runs at world size 1 (`DDPGRAPH_GPU_WORLD=1`) or 2. Timings are printed, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpgraph.bench import validate
from launcher import gpu_world, torchrun_env

pytestmark = pytest.mark.gpu
# Each bucket holds a third of the lengths: every bucket's graph is captured in warm-up.
BUCKETS = [256, 384, 512]


def _bench(out: Path, *args: str) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "ddpgraph",
        "bench",
        "--nproc",
        str(gpu_world()),
        "--steps",
        "20",
        "--json",
        "varlen.json",
        *args,
    ]
    proc = subprocess.run(
        cmd, cwd=out, env=torchrun_env(), capture_output=True, text=True, timeout=600, check=False
    )
    (out / "bench.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "varlen.json").read_text())
    assert validate(data) == []
    return data


def test_bucketed_row_replays_a_graph_per_bucket(tmp_path: Path) -> None:
    data = _bench(
        tmp_path,
        "--model",
        "gpt",
        "--seq-lens",
        "129:512",
        "--buckets",
        ",".join(map(str, BUCKETS)),
        "--strategies",
        "eager,whole",
    )
    rows = {r["strategy"]: r for r in data["results"]}
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r["reason"])
    family = rows["whole+buckets"]["varlen"]
    assert family["graphs_held"] == len(BUCKETS) and family["captures"] == len(BUCKETS), family
    assert family["eager_after_warmup"] == 0, family
    reference = rows["whole+buckets T=512 alone"]["varlen"]
    assert family["pool_mib"] and reference["pool_mib"], (family, reference)
    (summary,) = data["summary"]
    assert summary["judged"] and summary["pool_ratio"] == pytest.approx(
        family["pool_mib"] / reference["pool_mib"]
    )
    assert summary["fixed_speedup"] is not None and summary["share_of_fixed_speedup"] is not None
    # The one-graph row replays only when its captured length comes round again.
    assert rows["whole"]["varlen"]["eager_after_warmup"] > 0


def test_every_row_runs(tmp_path: Path) -> None:
    data = _bench(
        tmp_path,
        "--model",
        "varlen_models:small_lm",
        "--seq-lens",
        "33:256",
        "--profile-steps",
        "0",
    )
    rows = {r["strategy"]: r for r in data["results"]}
    assert len(rows) == 9
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r["reason"])
    assert rows["compile+buckets"]["varlen"]["captures"] >= 1, rows["compile+buckets"]
