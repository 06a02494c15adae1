#!/bin/bash
# One device call (nvidia-h200-x2, carry .whl) for the engine thread (issue 16): the prefill worker's closed
# loop with engine_thread off vs on (per-phase breakdown, bench/gpu_prefill_profile.py), then open-loop
# Poisson TTFT at ~30/50/70 % of the prefill bound, off vs on, for the M/D/1 comparison
# (bench/gpu_prefill_mdl_report.py reads the records).
set -u
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import torch, fastapi, uvicorn; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())" || exit 1
for t in off on; do
  timeout 150 python3 bench/gpu_prefill_profile.py --devices cuda:0,cuda:1 --output 16 --out "$OUT/prefill_thread_$t.json" \
    --extra "{\"prefill\": {\"engine_thread\": \"$t\"}, \"decode\": {\"engine_thread\": \"$t\"}}" 2>&1 \
    | grep -E '"(throughput_rps|failed|wall|in_step|idle|host_between_steps|phase_|error|startup_s)"'
done
for t in on off; do
  timeout 200 python3 bench/gpu_slo_study.py --layout 1p1d --long 2048,16 --points "long:${RATES:-6,10,14}" \
    --num-prompts "${N:-300}" --engine-thread $t --budget-s 190 --out "$OUT/mdl_thread_$t.json.gz" 2>&1 | grep -v Warning
done
