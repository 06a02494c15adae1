#!/bin/bash
# One device call on one GPU: GPU tests, cuda_ipc bench, engine bench.
# Usage on the device: bash bench/gpu_engine_run.sh   (carry .whl: fastapi etc. for the tests that
# import the serving stack). Writes JSON and logs under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name rc=$? $((SECONDS - t0))s"; tail -${TAIL:-12} "$OUT/$name.log"; }
TAIL=25 step gpu_tests 150 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider
step kv_transfer_gpu 60 python3 bench/kv_transfer_gpu.py --out "$OUT/kv_transfer_gpu.json" --src cuda:0 --dst cuda:0
step gpu_engine 150 python3 bench/gpu_engine.py --out "$OUT/gpu_engine.json"
