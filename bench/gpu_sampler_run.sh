#!/bin/bash
# One device call (~2-3 min on an H200): the sampler's cost per decode step, 7B preset, CUDA graphs,
# batch 1/8/64/128, 511-token prompts (bench/sampler_cost.py). GEMV tuning skipped (the same for every
# variant; it only shortens the call). Writes $OUT/sampler_gpu.json.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD DISTSERVE_GEMV_TUNE=0
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
timeout 200 python3 bench/sampler_cost.py --device cuda --model preset:llama-2-7b --batches 1 8 64 128 \
  --context 511 --steps 6 --rounds 3 --kv-mb 48000 --out "$OUT/sampler_gpu.json"
echo "rc=$?"
