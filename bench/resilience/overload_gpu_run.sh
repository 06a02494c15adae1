#!/bin/bash
# One device call (nvidia-h200, carry .whl), about 7 minutes: the open-loop part of bench/resilience/overload_cpu.py
# (issue 26: predicted vs measured TTFT of admitted requests, median / P90 error, goodput and shed share at 1x, 2x,
# 4x a capacity measured first) on CUDA workers (1 prefill + 1 decode on the one GPU), where the CPU VM's idle noise
# floor (53-84 % P90) does not hide the 25 % aim: preset:tiny-gpu (TTFT SLO 200 ms, 20 s per rate), then the 7B preset
# (random weights, TTFT SLO 250 ms, 35 s per rate, capacity from 32 closed-loop users). Admission-off run skipped.
# Arguments are added to both runs (e.g. --open-rates 1,2). JSON, logs and the request
# journals (gzipped) under $OUT. PARTS="llama7b" (or "tiny") runs one of the two.
set -u
source "$(dirname "$0")/../lib/gpu_env.sh"
set -o pipefail
START=$(date +%s)
run() {  # NAME LIMIT_S ARGS...: one open-loop run, its result in $OUT/NAME.json
  local name=$1 limit=$2
  shift 2
  local work=/tmp/overload_gpu/$name
  rm -rf "$work"
  timeout "$limit" python3 -m bench.resilience.overload_cpu --parts openloop --device cuda --open-no-off \
    --workdir "$work" --out "$OUT/$name.json" "$@" 2>&1 | grep -v Warning | tee "$OUT/$name.log"
  echo "$name: rc ${PIPESTATUS[0]}, $(( $(date +%s) - START )) s since start"
  gzip -c "$work/openloop/requests.jsonl" > "$OUT/$name-requests.jsonl.gz" 2>/dev/null || true
  mkdir -p "$OUT/$name-logs" && cp "$work"/openloop/open/logs/*.log "$OUT/$name-logs/" 2>/dev/null || true
}
PARTS=${PARTS:-tiny llama7b}
[[ " $PARTS " == *" tiny "* ]] && run tiny 200 --open-model preset:tiny-gpu --open-slo-ms 200 --open-duration 20 "$@"
[[ " $PARTS " == *" llama7b "* ]] && run llama7b 300 --open-model preset:llama-2-7b --open-slo-ms 250 --open-duration 35 --open-capacity-users 32 "$@"
echo "wall $(( $(date +%s) - START )) s"
