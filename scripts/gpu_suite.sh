#!/usr/bin/env bash
# The GPU run, in stages that each fit one 10-minute call on one GPU; results under $OUT.
#
#   scripts/gpu_suite.sh [STAGE ...]          (default: tests demo bench)
#
# Stages:
#   tests-core        tests/gpu/test_core_gpu.py         (capture_step against eager)
#   tests-training    tests/gpu/test_training_gpu.py     (scaler, accumulation, monitor, ...)
#   tests-strategies  tests/gpu/test_strategies_gpu.py   (make_step's strategies)
#   tests-doctor      tests/gpu/test_doctor.py           (ddpgraph doctor on every script)
#   tests-feeds       tests/gpu/test_feeds_gpu.py        (DataLoaders, prefetchers, threads; a
#                     fresh process per case, and 20 captures in a row: about 3 min)
#   tests-rank-safety, tests-adopt, tests-lightning, tests-accelerate, tests-presets,
#   tests-watchdog, tests-family, tests-optim, tests-schedules, tests-bench-varlen,
#   tests-trainer, tests-families, tests-frozen, tests-capture-call
#                     the test_<name>_gpu.py file of each
#   tests-docs        the Python blocks of README.md and docs/*.md, on the GPUs
#   tests-docs-commands  the bash blocks marked gpu-only (the published benchmark run)
#   tests             all of tests/gpu in one pytest run (longer than one call on one GPU)
#   demo              ddpgraph demo
#   bench             ddpgraph bench (BENCH_ARGS, default: the published run)
#
# On one GPU run one stage per call, e.g. `scripts/gpu_suite.sh tests-core`. The world size
# follows the GPUs present (two, or one on a one-GPU machine, where the checks that compare
# ranks skip); DDPGRAPH_GPU_WORLD overrides it.
#
# Each stage has its own time limit (<STAGE>_TIMEOUT in seconds, e.g. TESTS_CORE_TIMEOUT;
# defaults below) and writes its own summary, $OUT/<stage>.md, also when it ran out of
# time; the bench adds bench.json and bench.png. Everything else (logs, junit files,
# demo.json, pytest's folders) goes into $OUT/debug.tar.gz: the lent machine returns at
# most 8 files from $OUT. Written for that machine, which reaches no package registry:
# the project is installed without dependencies (the image has torch, rich, matplotlib,
# pytest).
set -uo pipefail
OUT=${OUT:-$PWD/out}
STAGES=${*:-tests demo bench}
export PYTHONUNBUFFERED=1
# Keep NVLink multicast off, as this machine's owners ask; harmless elsewhere.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}

declare -A TESTS=(
  [tests-core]=tests/gpu/test_core_gpu.py
  [tests-training]=tests/gpu/test_training_gpu.py
  [tests-strategies]=tests/gpu/test_strategies_gpu.py
  [tests-doctor]=tests/gpu/test_doctor.py
  [tests-feeds]=tests/gpu/test_feeds_gpu.py
  [tests-rank-safety]=tests/gpu/test_rank_safety_gpu.py
  [tests-adopt]=tests/gpu/test_adopt_gpu.py
  [tests-lightning]=tests/gpu/test_lightning_gpu.py
  [tests-accelerate]=tests/gpu/test_accelerate_gpu.py
  [tests-presets]=tests/gpu/test_presets_gpu.py
  [tests-watchdog]=tests/gpu/test_watchdog_gpu.py
  [tests-family]=tests/gpu/test_family_gpu.py
  [tests-optim]=tests/gpu/test_optim_gpu.py
  [tests-schedules]=tests/gpu/test_schedules_gpu.py
  [tests-bench-varlen]=tests/gpu/test_bench_varlen_gpu.py
  [tests-trainer]=tests/gpu/test_trainer_gpu.py
  [tests-families]=tests/gpu/test_families_gpu.py
  [tests-frozen]=tests/gpu/test_frozen_gpu.py
  [tests-capture-call]=tests/gpu/test_capture_call_gpu.py
  [tests-docs]=tests/gpu/test_doc_blocks_gpu.py::test_python_blocks_run_on_the_gpus
  [tests-docs-commands]=tests/gpu/test_doc_blocks_gpu.py::test_gpu_only_commands_run
  [tests]=tests/gpu
)
declare -A LIMIT=(
  [tests-core]=540 [tests-training]=540 [tests-strategies]=540 [tests-doctor]=540
  [tests-docs]=540 [tests-docs-commands]=540 [tests]=1800 [demo]=300 [bench]=540
  [tests-rank-safety]=300 [tests-adopt]=300 [tests-lightning]=300 [tests-accelerate]=300
  [tests-presets]=300 [tests-watchdog]=400 [tests-family]=300 [tests-optim]=300 [tests-schedules]=300
  [tests-bench-varlen]=400 [tests-feeds]=400 [tests-trainer]=420 [tests-families]=420 [tests-frozen]=400
  [tests-capture-call]=300
)

for stage in $STAGES; do
  if [[ -z "${TESTS[$stage]:-}" && "$stage" != demo && "$stage" != bench ]]; then
    echo "unknown stage '$stage'; stages: ${!TESTS[*]} demo bench" >&2
    exit 2
  fi
done

mkdir -p "$OUT"
DEBUG=/tmp/ddpgraph-gpu-debug
rm -rf "$DEBUG"; mkdir -p "$DEBUG"
LOG="$DEBUG/run.log"

{
  echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) stages: $STAGES"
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
  python3 - <<'PY'
import torch, sys
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())))
print("gpus", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
sys.path.insert(0, "tests")
from launcher import gpu_world
print("world size", gpu_world())
PY
  nvidia-smi topo -m 2>&1 | head -8
} > "$DEBUG/env.txt" 2>&1
cat "$DEBUG/env.txt"

run_stage() {  # run_stage STAGE COMMAND...: the command under the stage's time limit
  local stage=$1; shift
  local var="${stage//-/_}_TIMEOUT"; var=${var^^}
  local limit=${!var:-${LIMIT[$stage]}}
  local start=$SECONDS
  echo "== $stage (limit ${limit} s)" | tee -a "$LOG"
  # SIGINT first: pytest then writes its junit report of the tests that finished, and
  # torchrun stops its workers; SIGKILL 30 s later if anything is left.
  timeout -s INT -k 30 "$limit" "$@" 2>&1 | tee -a "$LOG" "$DEBUG/$stage.log"
  local rc=${PIPESTATUS[0]}
  python3 scripts/gpu_summary.py --stage "$stage" --debug "$DEBUG" --out "$OUT" \
    --rc "$rc" --seconds $((SECONDS - start)) --limit "$limit" > "$OUT/$stage.md" 2>>"$LOG"
  cat "$OUT/$stage.md"
}

for stage in $STAGES; do
  case $stage in
    demo)
      run_stage demo ddpgraph demo --json "$DEBUG/demo.json" ;;
    bench)
      run_stage bench ddpgraph bench ${BENCH_ARGS:---model gpt,resnet18} --json "$OUT/bench.json" --plot "$OUT/bench.png" ;;
    *)
      run_stage "$stage" python3 -m pytest -m gpu ${GPU_TESTS:-${TESTS[$stage]}} -q -p no:cacheprovider \
        --basetemp="$DEBUG/pytest-$stage" --junitxml="$DEBUG/$stage.xml" ;;
  esac
done
tar -czf "$OUT/debug.tar.gz" -C "$DEBUG" . 2>/dev/null
