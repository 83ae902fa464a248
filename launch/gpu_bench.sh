#!/usr/bin/env bash
# Run launch.bench on one GPU with a larger random Qwen2.5-VL-shaped model (configs/bench_gpu.flags).
#   launch/gpu_bench.sh OUT_DIR [extra launch.bench flags]
# Writes OUT_DIR/bench.json (the JSON line), OUT_DIR/bench.log, and each mode's trace.json plus
# plots/timeline_compare.png under OUT_DIR/run/; then OUT_DIR/rollout.json (launch.bench_rollout). Sized to finish in well under 8 minutes on an H100/H200.
# Needs jax with CUDA, torch with CUDA and transformers (the lent GPU image has them; no vllm needed).
set -euo pipefail
out="${1:?usage: launch/gpu_bench.sh OUT_DIR [flags]}"; shift || true
mkdir -p "$out"
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # torch and JAX share the GPU: allocate on demand
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt" || true
PYTHONUNBUFFERED=1 timeout 470 python -m launch.bench --flagfile=configs/bench_gpu.flags \
  --workdir="$out/run" --bench_steps=5 --bench_warmup=2 "$@" 2>&1 | tee "$out/bench.log"
tail -n 1 "$out/bench.log" > "$out/bench.json"
cat "$out/bench.json"
# The rollout alone, one prefill per prompt vs one per answer (issue 19), on the same model and batch.
PYTHONUNBUFFERED=1 timeout 100 python -m launch.bench_rollout --flagfile=configs/bench_gpu.flags \
  --workdir="$out/rollout" --rollout_repeats=3 2>&1 | tee "$out/rollout.log" || true
tail -n 1 "$out/rollout.log" > "$out/rollout.json"
