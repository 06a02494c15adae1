#!/bin/bash
# One device call (nvidia-h200, carry .whl), about 8 minutes: bench/serving/gpu_split_memory.py --variant memcheck
# (each layout's start-up memory per worker, a smoke of 8 requests, a tuners-off retry of a split whose smoke
# failed, then the 128/64 goodput sweep, greedy and OpenAI-default, 300 requests per point). Arguments go to the
# script (e.g. --layouts / --sweep / --workloads / --budget-s, or --variant ab --ab-tree PATH). JSON under $OUT.
set -u
source "$(dirname "$0")/../lib/gpu_env.sh"
which nvidia-cuda-mps-control || echo "no nvidia-cuda-mps-control on the PATH: split layouts will be refused"
set -o pipefail
START=$(date +%s)
python3 -m bench.serving.gpu_split_memory --out "$OUT/split_memory.json" "$@" 2>&1 | grep -v Warning \
  | tee "$OUT/split_memory.log"
echo "wall $(( $(date +%s) - START )) s"
