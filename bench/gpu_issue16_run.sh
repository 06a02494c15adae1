#!/bin/bash
# One device call for issue 16 (carry .whl): cuda_ipc tests (the x2 race fix), KV sizing from
# gpu_memory_utilization + engine-only prefill loop (+ torch.profiler table), then the prefill
# worker's closed loop through the real server with its per-phase breakdown, for each TAG=ARGS
# given (e.g. out16="--output 16" out1="--output 1").
set -u
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import sys, torch, fastapi, uvicorn; print(sys.version.split()[0], 'torch', torch.__version__, 'gpus', torch.cuda.device_count())" || exit 1
[ "${SKIP_BASE:-0}" = 1 ] || {
timeout 120 python3 -m pytest tests/gpu/test_cuda_ipc.py -q -rs -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
timeout 150 python3 bench/gpu_kv_sizing.py --out "$OUT/kv_sizing.json" 2>&1 | grep -v Warning | tail -6; }
devs=cuda:0,cuda:1
[ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" = 1 ] && devs=cuda:0,cuda:0
for spec in "$@"; do
  tag=${spec%%=*}; args=${spec#*=}
  # shellcheck disable=SC2086
  timeout 150 python3 bench/gpu_prefill_profile.py --devices $devs --out "$OUT/prefill_$tag.json" $args 2>&1 \
    | grep -E '"(throughput_rps|requests|failed|p50|p90|wall|in_step|step_cpu|idle|host_between_steps|phase_|error|startup_s)"'
done
