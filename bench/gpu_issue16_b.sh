#!/bin/bash
# One device call (nvidia-h200-x2, carry .whl) after the one-forward refactor (issue 16): the GPU tests, the
# graph-vs-eager test 4 more times (it was flaky on this kind), the engine bench (decode batch 1, prefill 2048),
# the cuda_ipc pull, and the prefill step on ShareGPT lengths (bench/gpu_prefill_lengths.py).
set -u
source "$(dirname "$0")/gpu_env.sh"
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name rc=$? $((SECONDS - t0))s"; tail -${TAIL:-6} "$OUT/$name.log"; }
TAIL=12 step gpu_tests 150 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider
for i in 1 2 3 4; do
  step graph_eager_$i 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py -k test_cuda_graph_decode_tokens_equal_eager
done
step gpu_engine 120 python3 bench/gpu_engine.py --out "$OUT/gpu_engine.json"
step prefill_lengths 120 python3 bench/gpu_prefill_lengths.py --out "$OUT/prefill_lengths.json"
step kv_transfer_gpu 45 python3 bench/kv_transfer_gpu.py --out "$OUT/kv_transfer_gpu.json" --src cuda:0 --dst cuda:0
