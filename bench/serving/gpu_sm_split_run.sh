#!/bin/bash
# One device call for issue 31 (nvidia-h200, carry .whl): colocated / 1P1D / 1P1D on MPS SM splits, open loop
# (bench/gpu_sm_split.py; arguments go to it).
set -u
source "$(dirname "$0")/../lib/gpu_env.sh"
which nvidia-cuda-mps-control || echo "no nvidia-cuda-mps-control on the PATH"
set -o pipefail
python3 -m bench.serving.gpu_sm_split --out "$OUT/sm_split.json" "$@" 2>&1 | grep -v Warning | tee "$OUT/sm_split.log"
