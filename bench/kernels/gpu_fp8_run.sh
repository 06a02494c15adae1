#!/bin/bash
# One device call (issue 32), <= 8 minutes: the FP8 GPU tests, then bench/gpu_fp8.py (kernel table, then one
# process per engine variant, each with its own time limit). Usage on the device, from the repository root:
#   bash bench/gpu_fp8_run.sh          (no wheels needed: the tests and the bench import torch and the engine)
# Results: $OUT/gpu_fp8.json (written after every measurement), $OUT/*.log.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" || \
  echo "torch/triton missing: the bench and the tests need both (the device image has them)"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name rc=$? $((SECONDS - t0))s"; tail -${TAIL:-14} "$OUT/$name.log"; }
# the tests' engines skip the start-up tuning (the tuner has its own test; the bench's engines run it)
DISTSERVE_DECODE_TUNE=0 TAIL=30 step gpu_tests ${TESTS_S:-100} \
  python3 -m pytest tests/gpu/test_fp8.py -q -x -rs -p no:cacheprovider --durations=8
TAIL=60 step gpu_fp8 ${BENCH_S:-380} python3 -m bench.kernels.gpu_fp8 --out "$OUT/gpu_fp8.json" --variant-timeout-s ${VARIANT_S:-78} ${BENCH_ARGS:-}
