#!/bin/bash
# The one device-side helper: the GPU machine's environment (bench/lib/gpu_env.sh: $OUT, NVLink multicast off, the
# carried wheels on PYTHONPATH), then a registered study's steps through the runner, each step's log in $OUT.
#   bash bench/lib/device.sh ID [--variant V] [-- ARGS]        (python -m bench run ID --device-call prints it)
set -u
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import yaml" 2>/dev/null || { echo "pyyaml is missing on the device: carry its wheel in .whl/"; exit 1; }
exec python3 -m bench run "$1" --on-device "${@:2}"
