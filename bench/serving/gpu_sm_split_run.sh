#!/bin/bash
# One device call for issue 31 (nvidia-h200, carry .whl), about 8.5 minutes in all:
#  1. the KV hand-off by reference vs by copy at 256 MiB and 1 GiB (bench/gpu_kv_by_reference.py, ~40 s);
#  2. prefill and decode step times at SM shares $SHARES (100,40,30 by default; planner/sm_shares.py: one MPS
#     client per share, 7B preset; at most $SHARES_S seconds, 90 by default);
#  3. serving: colocated (chunked prefill, max_num_batched_tokens 512), 1P1D on a 60:40 SM split by reference
#     and by copy, 1P1D unpartitioned (last: skipped when the budget is spent); 128/64 (300 requests per point) and
#     2048/128 (80 per point), open loop (bench/gpu_sm_split.py; arguments go to
#     it, e.g. --layouts / --workloads / --sampling / --budget-s). Both write JSON under $OUT as they go.
set -u
source "$(dirname "$0")/../lib/gpu_env.sh"
which nvidia-cuda-mps-control || echo "no nvidia-cuda-mps-control on the PATH: split layouts will fail"
set -o pipefail
START=$(date +%s)
timeout 120 python3 -m bench.kv_transfer.gpu_kv_by_reference --out "$OUT/kv_by_reference.json" 2>&1 | grep -v Warning \
  | tee "$OUT/kv_by_reference.log"
timeout $(( ${SHARES_S:-90} + 60 )) python3 -m distserve.planner.sm_shares --device cuda --model preset:llama-2-7b \
  --shares "${SHARES:-100,40,30}" --budget-s "${SHARES_S:-90}" --out "$OUT/sm_shares.json" 2>&1 \
  | grep -v Warning | tail -40 | tee "$OUT/sm_shares.log"
LEFT=$(( 500 - ($(date +%s) - START) ))
python3 -m bench.serving.gpu_sm_split --out "$OUT/sm_split.json" --budget-s "$LEFT" \
  --workloads "128/64=60,80,100;2048/128@80=5,9" --drain-estimate-s 6 "$@" 2>&1 | grep -v Warning \
  | tee "$OUT/sm_split.log"
echo "wall $(( $(date +%s) - START )) s"
