#!/bin/bash
# Second device call of the issue-16 study (nvidia-h200-x2, carry .whl): the SDPA new-shape cost, the
# study's points affected by it rerun with flash-first prefill attention (both layouts), then tests/gpu.
set -u
source "$(dirname "$0")/gpu_env.sh"
timeout 60 python3 bench/gpu_sdpa_shapes.py --out "$OUT/sdpa_shapes.json" 2>&1 | grep -v Warning
S="python3 bench/gpu_slo_study.py --prewarm 48"
$S --layout 1p1d --points "summ:10,15,20;sharegpt:12,24,36" --budget-s 250 \
  --out "$OUT/slo_study_1p1d_flash.json.gz" 2>&1 | grep -v Warning | tee "$OUT/slo_study_flash.log"
$S --layout colocated2 --points "long:8;summ:10,15,20;sharegpt:24" --budget-s 205 \
  --out "$OUT/slo_study_colocated2_flash.json.gz" 2>&1 | grep -v Warning | tee -a "$OUT/slo_study_flash.log"
timeout 75 python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests_x2.txt"
