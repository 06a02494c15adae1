#!/bin/bash
# One device call of the SLO study (nvidia-h200-x2, carry .whl): LAYOUT = 1p1d | colocated2, further
# arguments go to bench/gpu_slo_study.py (e.g. --points 'long:8,12'). The log is kept under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
layout=$1; shift
python3 -c "import torch, fastapi, uvicorn; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())" || exit 1
set -o pipefail
python3 bench/gpu_slo_study.py --layout "$layout" "$@" 2>&1 | grep -v Warning | tee "$OUT/slo_study_$layout.log"
