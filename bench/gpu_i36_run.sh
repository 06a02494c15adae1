#!/bin/bash
# One device call for issue 36 (nvidia-h200, carry .whl): the seed's form with default settings on one GPU
# (1p1d, colocated, 1p2d) and nan-check of the 7B preset (bench/gpu_one_gpu_defaults.py); arguments go to it.
set -u
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import torch, fastapi, uvicorn, aiohttp; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())" || exit 1
set -o pipefail
python3 bench/gpu_one_gpu_defaults.py --out "$OUT/one_gpu_defaults.json" "$@" 2>&1 | grep -v Warning | tee "$OUT/one_gpu_defaults.log"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
