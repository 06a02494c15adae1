#!/bin/bash
# One device call (see bench/gpu_serving.py): carried wheels, cuda_ipc tests, cuda_ipc bench,
# serving comparison. Usage on the device: bash bench/gpu_serving_run.sh one-gpu|two-gpu BUDGET_S
# (carry .whl: fastapi, starlette, pydantic(-core), uvicorn, httptools, ... are not in the image).
set -u
layout=$1
budget=${2:-250}
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import fastapi, uvicorn, pydantic, aiohttp, torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'alloc_conf', __import__('os').environ.get('PYTORCH_CUDA_ALLOC_CONF'))"
if [ "$layout" = one-gpu ]; then
  timeout 90 python3 -m pytest tests/gpu/test_cuda_ipc.py -q -rs -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
  timeout 60 python3 bench/kv_transfer_gpu.py --out "$OUT/kv_transfer_gpu.json" --src cuda:0 --dst cuda:0
else
  timeout 75 python3 -m pytest tests/gpu/test_cuda_ipc.py -q -rs -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
  timeout 45 python3 bench/kv_transfer_gpu.py --out "$OUT/kv_transfer_gpu_same.json" --src cuda:0 --dst cuda:0 --repeats 8
  timeout 45 python3 bench/kv_transfer_gpu.py --out "$OUT/kv_transfer_gpu_x2.json" --src cuda:0 --dst cuda:1 --repeats 8
fi
python3 bench/gpu_serving.py --layout "$layout" --budget-s "$budget" --startup-timeout-s 150 "${@:3}" \
  --out "$OUT/gpu_serving_$layout.json" 2>&1 | tee "$OUT/gpu_serving_$layout.log" | grep -v "^\s*$"
