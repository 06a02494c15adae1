#!/bin/bash
# One device call for issue 16 on nvidia-h200-x2 (carry .whl): cuda_ipc tests (the x2 race fix),
# KV sizing from gpu_memory_utilization + engine-only prefill loop (+ torch.profiler table),
# the prefill worker's closed loop through the real server with its per-phase breakdown.
set -u
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'gpus', torch.cuda.device_count())"
timeout 120 python3 -m pytest tests/gpu/test_cuda_ipc.py -q -rs -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
timeout 150 python3 bench/gpu_kv_sizing.py --out "$OUT/kv_sizing.json" 2>&1 | grep -v Warning | tail -40
timeout 200 python3 bench/gpu_prefill_profile.py --devices cuda:0,cuda:1 --out "$OUT/prefill_profile.json" "$@" 2>&1 | tail -45
