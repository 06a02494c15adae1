#!/bin/bash
# One device call (nvidia-h200, carry .whl with py-spy's wheel in it), about 5 minutes: the host CPU per request of
# every serving process (router, workers, client) in colocated and 1P1D at 7B, with a py-spy profile at the last
# rate. Arguments go to bench/serving/cpu_per_request.py. JSON: $OUT/cpu_per_request.json.
set -u
source "$(dirname "$0")/../lib/gpu_env.sh"
export PATH=/tmp/site/bin:$PATH
nproc; grep -m1 "model name" /proc/cpuinfo
set -o pipefail
python3 -m bench.serving.cpu_per_request --out "$OUT/cpu_per_request.json" "$@" 2>&1 | grep -v Warning \
  | tee "$OUT/cpu_per_request.log"
