#!/usr/bin/env bash
# The GPU suite on one GPU in one 10-minute call: groups of test files run side by side
# (each test launches its own torchrun workers on free ports; an H200 has room for all),
# the doctor's score beside them. Results under $OUT: one log per group and a summary.
#
#   scripts/gpu_parallel.sh            (world size: min(2, GPUs present))
#   scripts/gpu_parallel.sh d1 d2      (only those groups, and no doctor score)
#
# Timings printed by tests are not comparable across runs of this script: the groups share
# the GPU and the CPU. Benchmarks run alone (`scripts/gpu_suite.sh bench`).
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
LIMIT=${GPU_PARALLEL_TIMEOUT:-480}
STARTED=$(mktemp)  # the torchrun logs newer than this are this run's
python3 -c "import torch, sys; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count(), 'python', sys.version.split()[0])" > "$OUT/summary.txt"

declare -A GROUPS_=(
  [a]="tests/gpu/test_core_gpu.py tests/gpu/test_rank_safety_gpu.py tests/gpu/test_adopt_gpu.py tests/gpu/test_presets_gpu.py"
  [b]="tests/gpu/test_training_gpu.py tests/gpu/test_strategies_gpu.py tests/gpu/test_accelerate_gpu.py tests/gpu/test_lightning_gpu.py"
  [c]="tests/gpu/test_watchdog_gpu.py tests/gpu/test_optim_gpu.py tests/gpu/test_family_gpu.py tests/gpu/test_bench_varlen_gpu.py"
  # DataLoaders, prefetchers and threads: a fresh process per case, in two halves.
  [e1]="tests/gpu/test_feeds_gpu.py::test_every_dataloader_setup_feeds_captured_steps tests/gpu/test_feeds_gpu.py::test_compile_replays_the_pinned_loaders_batches"
  [e2]="tests/gpu/test_feeds_gpu.py --deselect tests/gpu/test_feeds_gpu.py::test_every_dataloader_setup_feeds_captured_steps --deselect tests/gpu/test_feeds_gpu.py::test_compile_replays_the_pinned_loaders_batches"
  [f]="tests/gpu/test_frozen_gpu.py tests/gpu/test_schedules_gpu.py tests/gpu/test_capture_call_gpu.py"
  [g]="tests/gpu/test_trainer_gpu.py tests/gpu/test_families_gpu.py"
  # The doctor's other GPU checks (plain runs, the library chain); its marks are scored
  # beside the groups by score.py, which runs the scripts four at a time. And the docs'
  # Python blocks on the GPU (the published benchmark command stays a stage of its own).
  # Forty-odd torchrun launches of a dozen seconds each: split in three (d1, d2, d3), as
  # two halves took 405 s each and one went past the call's limit (run 69).
  [d]="tests/gpu/test_doctor.py --deselect tests/gpu/test_doctor.py::test_findings_are_exactly_the_marked_ones tests/gpu/test_doc_blocks_gpu.py::test_python_blocks_run_on_the_gpus"
)
# shellcheck disable=SC2086
mapfile -t D_IDS < <(python3 -m pytest -m gpu --co -q -p no:cacheprovider ${GROUPS_[d]} 2>/dev/null | grep '::')
unset 'GROUPS_[d]'
for i in "${!D_IDS[@]}"; do GROUPS_[d$((i % 3 + 1))]+=" ${D_IDS[$i]}"; done
WANTED=("$@")
[ ${#WANTED[@]} -eq 0 ] && WANTED=("${!GROUPS_[@]}")
for g in "${WANTED[@]}"; do
  # shellcheck disable=SC2086
  timeout "$LIMIT" python3 -m pytest -m gpu ${GROUPS_[$g]} -q -p no:cacheprovider -rfEs --timeout 300 \
    > "$OUT/group-$g.log" 2>&1 &
done
if [ $# -eq 0 ]; then
  timeout "$LIMIT" python3 tests/doctor_scripts/score.py --nproc 1 --jobs 4 --out "$OUT/doctor_score.json" \
    > "$OUT/doctor.log" 2>&1 &
fi
wait
for f in "$OUT"/group-*.log; do
  echo "== $(basename "$f"): $(grep -E 'passed|failed|error' "$f" | tail -1)" >> "$OUT/summary.txt"
  grep -E '^(FAILED|ERROR)' "$f" | cut -c1-220 >> "$OUT/summary.txt"
done
if [ -f "$OUT/doctor.log" ]; then
  echo "== doctor score" >> "$OUT/summary.txt"
  grep -vE ': right [0-9]+ wrong 0 missed 0$' "$OUT/doctor.log" | tail -30 >> "$OUT/summary.txt"
fi
# The run tool brings back at most 8 files: the logs travel as one archive, the
# scenarios' torchrun logs (their workers' own output) as another.
tar -czf "$OUT/logs.tar.gz" -C "$OUT" $(cd "$OUT" && ls group-*.log doctor.log 2>/dev/null) \
  && rm -f "$OUT"/group-*.log "$OUT/doctor.log"
find /tmp/pytest-of-"$(id -un)" -name torchrun.log -newer "$STARTED" 2>/dev/null \
  | tar -czf "$OUT/torchrun-logs.tar.gz" -T - 2>/dev/null
cat "$OUT/summary.txt"
