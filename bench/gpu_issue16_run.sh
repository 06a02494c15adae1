#!/bin/bash
# One device call for issue 16 on nvidia-h200-x2 (carry .whl): cuda_ipc tests (the x2 race fix),
# KV sizing from gpu_memory_utilization + engine-only prefill loop, cuda_ipc 1 GiB pull bench.
set -u
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'gpus', torch.cuda.device_count())"
timeout 120 python3 -m pytest tests/gpu/test_cuda_ipc.py -q -rs -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
timeout 180 python3 bench/gpu_kv_sizing.py --out "$OUT/kv_sizing.json" 2>&1 | grep -v Warning | tail -8
timeout 60 python3 bench/kv_transfer_gpu.py --out "$OUT/kv_transfer_gpu_same.json" --src cuda:0 --dst cuda:0 --repeats 8 2>&1 | tail -12
