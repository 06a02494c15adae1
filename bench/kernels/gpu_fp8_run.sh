#!/bin/bash
# One device call (issue 32): the FP8 GPU tests, then bench/gpu_fp8.py. Usage on the device:
#   bash bench/gpu_fp8_run.sh          (no wheels needed: the tests and the bench import torch and the engine)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name rc=$? $((SECONDS - t0))s"; tail -${TAIL:-14} "$OUT/$name.log"; }
TAIL=30 step gpu_tests ${TESTS_S:-150} python3 -m pytest tests/gpu/test_fp8.py -q -x -rs -p no:cacheprovider
TAIL=40 step gpu_fp8 ${BENCH_S:-330} python3 -m bench.kernels.gpu_fp8 --out "$OUT/gpu_fp8.json" ${BENCH_ARGS:-}
