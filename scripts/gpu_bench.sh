#!/usr/bin/env bash
# The benchmarks and probes of the GPU machine, one after another (timings must not share
# the GPU), each under its own time limit so that one slow stage cannot take the rest of
# a 10-minute call. Logs and JSON under $OUT, one line per stage in $OUT/bench-summary.txt.
#
#   scripts/gpu_bench.sh STAGE [STAGE ...]
#
# Stages (rough time on one H200):
#   fidelity         scripts/probes/cpu_emulation_fidelity.py          (< 1 min)
#   demo             ddpgraph demo                                     (< 1 min)
#   presets-hf       ddpgraph bench on hf-gpt2, hf-llama, 5 strategies (3-4 min)
#   presets-vision   ddpgraph bench on timm-vit, tv-resnet50           (3-4 min)
#   optimizer        scripts/probes/optimizer_variants.py              (about 2 min)
#   varlen-gpt       scripts/probes/varlen_bench.py --model gpt        (2-3 min)
#   varlen-gpt2      scripts/probes/varlen_bench.py --model gpt2       (2-3 min)
#   varlen-bench     ddpgraph bench --seq-lens 64:512 on gpt, hf-gpt2  (5-9 min; its own
#                    limit of 570 s, the JSON keeps the rows done if it runs out)
#   varlen-hf        ddpgraph bench --seq-lens 64:512 on hf-gpt2, rows of eager, whole and
#                    compile (about 3.5 min; the reduce-overhead rows alone take longer)
#   presets-all      the four presets at batch 8, five strategies, one command: the
#                    published table from one run (7-9 min, its own limit of 570 s)
#   presets-b32      the four presets at batch 32: eager, whole, compile (4-6 min; B32_MODELS
#                    names fewer)
#   feeds-presets    the four presets at batch 8, five strategies, device feed and the
#                    pinned 4-worker DataLoader feed, 40 timed steps, no profile; then
#                    scripts/feed_ratio.py: each row's DataLoader/device ms ratio, target
#                    1.05 (6-8 min, its own limit of 540 s; $OUT/feeds-ratio.md)
#   feed-windows     scripts/probes/feed_windows.py on hf-llama and timm-vit: each feed's
#                    ms/step by timing window of 1-20 steps, side by side (2-4 min);
#                    WINDOW_MODELS, WINDOW_STRATS, and WINDOW_ARGS for more of its
#                    options ("--windows 10 --loaders 4:unpinned,0:pinned --paired 12
#                    --profile 10": more loaders, alternating windows, the host profiler)
#   integrations     scripts/probes/integrations_speed.py, torchrun 1  (1-2 min)
#   trainer          scripts/probes/trainer_bench.py, torchrun 1: plain transformers.Trainer,
#                    the graph-safe reference and CUDAGraphTrainer on hf-gpt2 and hf-llama,
#                    ms/step and parity (2-3 min; trainer.json and the table in trainer.log)
#   families         ddpgraph bench on hf-bert, hf-moe-bf16, tv-syncbn, hf-gpt2-ckpt at batch
#                    8: eager, reduce-overhead, whole (3-4 min; families.json)
#   watchdog         scripts/bench_watchdog.py --cuda                  (< 1 min)
#   verify-cost      scripts/probes/verify_cost.py on the four presets, batch 8: what the
#                    frozen-value watch costs per eager step, and verify_every=100 per
#                    step (2-4 min)
#   overhead         scripts/replay_overhead.py (host time per replay, CPU; with
#                    OLD_SRC=<dir> also the same script on that source, side by side)
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
LIMIT=${STAGE_TIMEOUT:-300}
STRATS=eager,reduce-overhead,recipe,whole,compile  # make_step's names (docs/benchmarks.md)

run() {  # run NAME CMD...: one stage under the time limit, its status in the summary
  local name=$1; shift
  local t0=$SECONDS
  timeout "$LIMIT" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/bench-summary.txt"
}

for stage in "$@"; do
  case "$stage" in
    fidelity) run fidelity python3 scripts/probes/cpu_emulation_fidelity.py ;;
    demo) run demo ddpgraph demo --json "$OUT/demo.json" ;;
    presets-hf) run presets-hf ddpgraph bench --model hf-gpt2,hf-llama --batch-sizes 8 --no-data-loader \
        --strategies "$STRATS" --json "$OUT/presets-hf.json" ;;
    presets-vision) run presets-vision ddpgraph bench --model timm-vit,tv-resnet50 --batch-sizes 8 \
        --no-data-loader --strategies "$STRATS" --json "$OUT/presets-vision.json" ;;
    optimizer) run optimizer python3 scripts/probes/optimizer_variants.py --json "$OUT/optimizer_variants.json" ;;
    varlen-gpt) run varlen-gpt python3 scripts/probes/varlen_bench.py --model gpt ;;
    varlen-gpt2) run varlen-gpt2 python3 scripts/probes/varlen_bench.py --model gpt2 ;;
    varlen-bench) LIMIT=570 run varlen-bench ddpgraph bench --model gpt,hf-gpt2 --seq-lens 64:512 \
        --batch-sizes 8 --json "$OUT/varlen-bench.json" --plot "$OUT/varlen-bench.png" ;;
    varlen-hf) run varlen-hf ddpgraph bench --model hf-gpt2 --seq-lens 64:512 --batch-sizes 8 \
        --strategies eager,whole,compile --json "$OUT/varlen-hf.json" --plot "$OUT/varlen-hf.png" ;;
    presets-all) LIMIT=570 run presets-all ddpgraph bench --model hf-gpt2,hf-llama,timm-vit,tv-resnet50 \
        --batch-sizes 8 --no-data-loader --strategies "$STRATS" --json "$OUT/presets-all.json" ;;
    presets-b32) run presets-b32 ddpgraph bench --model "${B32_MODELS:-hf-gpt2,hf-llama,timm-vit,tv-resnet50}" --batch-sizes 32 \
        --strategies eager,whole,compile --steps 30 --warmup 15 --profile-steps 0 --no-data-loader \
        --json "$OUT/presets-b32.json" ;;
    feeds-presets)
      LIMIT=540 run feeds-presets ddpgraph bench --model hf-gpt2,hf-llama,timm-vit,tv-resnet50 --batch-sizes 8 \
        --strategies "$STRATS" --steps 40 --warmup 15 --profile-steps 0 --json "$OUT/feeds-presets.json"
      python3 scripts/feed_ratio.py "$OUT/feeds-presets.json" | tee "$OUT/feeds-ratio.md" ;;
    feed-windows) run feed-windows torchrun --standalone --nproc_per_node=1 scripts/probes/feed_windows.py \
        --model "${WINDOW_MODELS:-hf-llama,timm-vit}" --strategies "${WINDOW_STRATS:-whole,compile,reduce-overhead}" \
        ${WINDOW_ARGS:-} --json "$OUT/feed-windows.json" ;;
    integrations) run integrations torchrun --standalone --nproc_per_node=1 scripts/probes/integrations_speed.py ;;
    trainer) run trainer torchrun --standalone --nproc_per_node=1 scripts/probes/trainer_bench.py \
        --json "$OUT/trainer.json" ;;
    families) run families ddpgraph bench --model hf-bert,hf-moe-bf16,tv-syncbn,hf-gpt2-ckpt --batch-sizes 8 \
        --strategies eager,reduce-overhead,whole --steps 30 --warmup 15 --profile-steps 0 --no-data-loader \
        --json "$OUT/families.json" ;;
    watchdog) run watchdog python3 scripts/bench_watchdog.py --cuda ;;
    verify-cost) run verify-cost torchrun --standalone --nproc_per_node=1 scripts/probes/verify_cost.py \
        --model hf-gpt2,hf-llama,timm-vit,tv-resnet50 --batch 8 --json "$OUT/verify_cost.json" ;;
    overhead)
      run overhead python3 scripts/replay_overhead.py --calls 500 --rounds 40
      if [ -n "${OLD_SRC:-}" ]; then
        PYTHONPATH=$OLD_SRC run overhead-old python3 scripts/replay_overhead.py --calls 500 --rounds 40
      fi ;;
    *) echo "unknown stage $stage" | tee -a "$OUT/bench-summary.txt" ;;
  esac
done
cat "$OUT/bench-summary.txt"
