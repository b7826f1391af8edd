#!/usr/bin/env bash
# The whole GPU run in one call: GPU tests, demo and benchmark, results under $OUT.
#
#   scripts/gpu_suite.sh [tests] [demo] [bench]      (default: all three)
#
# Each stage has a time limit (TESTS_TIMEOUT, DEMO_TIMEOUT, BENCH_TIMEOUT, in seconds), so
# a stage that runs long still leaves the summary of the others.
# Written for the lent GPU machine, which reaches no package registry: the project is
# installed without dependencies (the image has torch, rich, matplotlib, pytest) and
# everything lands in at most 8 files under $OUT.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
STAGES=${*:-tests demo bench}
export PYTHONUNBUFFERED=1
# Keep NVLink multicast off, as this machine's owners ask; harmless elsewhere.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
LOG="$OUT/run.log"
DEBUG=/tmp/ddpgraph-gpu-debug
rm -rf "$DEBUG"; mkdir -p "$DEBUG"
{
  echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) stages: $STAGES"
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
  python3 - <<'PY'
import torch, sys
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())))
print("gpus", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
  nvidia-smi topo -m 2>&1 | head -8
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [[ " $STAGES " == *" tests "* ]]; then
  echo "== GPU tests" | tee -a "$LOG"
  timeout "${TESTS_TIMEOUT:-1800}" python3 -m pytest -m gpu ${GPU_TESTS:-tests/gpu} -q -p no:cacheprovider --basetemp="$DEBUG/pytest" \
    --junitxml="$OUT/junit.xml" 2>&1 | tee -a "$LOG"
fi
if [[ " $STAGES " == *" demo "* ]]; then
  echo "== demo" | tee -a "$LOG"
  timeout "${DEMO_TIMEOUT:-600}" ddpgraph demo --json "$OUT/demo.json" 2>&1 | tee -a "$LOG"
fi
if [[ " $STAGES " == *" bench "* ]] && python3 -c "import ddpgraph.bench.command" 2>/dev/null; then
  echo "== bench" | tee -a "$LOG"
  timeout "${BENCH_TIMEOUT:-1200}" ddpgraph bench ${BENCH_ARGS:---model gpt,resnet18} --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee -a "$LOG"
fi
python3 scripts/gpu_summary.py "$OUT" > "$OUT/summary.md" 2>>"$LOG"
tar -czf "$OUT/debug.tar.gz" -C "$DEBUG" . 2>/dev/null
cat "$OUT/summary.md"
