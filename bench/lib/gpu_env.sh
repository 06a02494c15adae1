# Sourced by bench/lib/device.sh (and the study shell scripts) on the device: $OUT, multicast off (KINDS.md), the
# carried wheels (.whl: fastapi, uvicorn, pydantic... are not in the image) on PYTHONPATH.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
