#!/bin/bash
# The four-GPU ratio study (issue 19), on nvidia-h200-x4 (carry .whl): each LAYOUT given runs the SLO study
# (bench/gpu_slo_study.py) on its own server, one after the other, with the points below. Two layouts fit one
# 10-minute call at the defaults (about 3.5 min each); run it twice to cover 2p2d 3p1d, then 1p3d colocated4.
#   bash bench/gpu_x4_study.sh 2p2d 3p1d        then        bash bench/gpu_x4_study.sh 1p3d colocated4
# Points (POINTS=...): long 2048/128 and ShareGPT lengths around the knees the one-rate look (PERFORMANCE §13)
# and the planner suggest; 300 measured requests per point after a 30-request ramp, 48 pre-warm per workload.
# Report: python bench/gpu_slo_study_report.py bench/results/gpu_issue19_study/slo_study_*.json.gz --plot ...
set -u
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import torch, fastapi, uvicorn; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())" || exit 1
points=${POINTS:-long:12,16,24;sharegpt:24,48}
for layout in "$@"; do
  timeout 290 python3 bench/gpu_slo_study.py --layout "$layout" --points "$points" --num-prompts 330 --prewarm 48 \
    --budget-s 280 --out "$OUT/slo_study_$layout.json.gz" 2>&1 | grep -v Warning | tee "$OUT/slo_study_$layout.log" | tail -8
done
