#!/bin/bash
# One device call (~2-3 min on an H200, at most ~5): the sampler's GPU tests, then its cost per decode
# step, 7B preset, decode CUDA graphs, batch 8 and 64, 511-token prompts (bench/engine/sampler_cost.py): the old
# sampler (2026-12-01: full sort for top_p, eager after the model's graph), the new one eagerly, and the new
# one inside its CUDA graphs, interleaved in the same run. GEMV tuning skipped (the same for every
# variant; it only shortens the call). Needs only torch/triton/pytest (no wheels carried).
# Writes $OUT/gpu_sampler_tests.log, $OUT/sampler_gpu.json (rewritten after each batch size) and its log.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD DISTSERVE_GEMV_TUNE=0
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  || echo "torch/triton missing: the bench below cannot run"
t0=$SECONDS
if python3 -c "import pytest" 2>/dev/null; then
  timeout 130 python3 -m pytest tests/gpu/test_graph_sampler.py -q -rs -p no:cacheprovider > "$OUT/gpu_sampler_tests.log" 2>&1
  echo "== gpu tests rc=$? $((SECONDS - t0))s"; tail -15 "$OUT/gpu_sampler_tests.log"
else
  echo "== gpu tests skipped: pytest is not installed in this image" | tee "$OUT/gpu_sampler_tests.log"
fi
t0=$SECONDS
timeout 150 python3 -m bench.engine.sampler_cost --device cuda --model preset:llama-2-7b --batches 8 64 \
  --context 511 --steps 6 --rounds 3 --kv-mb 48000 --samplers old new graph graph-sort --out "$OUT/sampler_gpu.json" \
  > "$OUT/sampler_gpu.log" 2>&1
echo "== bench rc=$? $((SECONDS - t0))s"; tail -40 "$OUT/sampler_gpu.log"
