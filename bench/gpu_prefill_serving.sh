#!/bin/bash
# One device call (nvidia-h200, carry .whl; issue 17): the 1P1D prefill worker's step cost on the serving path
# against prompts per step, with the engine thread on and off. Both workers share cuda:0 (--one-gpu) and the
# workloads are prefill-bound (2 output tokens: the decode side does one step per request): ShareGPT prompt
# lengths at 12-64 req/s and 128-token prompts at 40-130 req/s, REPEATS servers per mode (MODES: on off).
# The planner's per-sequence constant is fitted from these records (planner/serving_records.fit_prefill_per_seq);
# bench/plan_accuracy.py prints each point measured vs replayed.
set -u
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import torch, fastapi, uvicorn; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())" || exit 1
POINTS=${POINTS:-"sharegpt_p:12,24,36,48,64;short_p:40,70,100,130"}
for r in $(seq 1 "${REPEATS:-1}"); do
for t in ${MODES:-on off}; do
  timeout "${LIMIT:-280}" python3 bench/gpu_slo_study.py --layout 1p1d --one-gpu --gpu-memory-utilization 0 \
    --kv-cache-mb 16000 --pool-mb 2048 --points "$POINTS" --prewarm 32 --num-prompts "${N:-300}" \
    --engine-thread "$t" --budget-s "${BUDGET:-260}" --out "$OUT/prefill_serving_thread_${t}_r$r.json.gz" 2>&1 | grep -v Warning
done
done
