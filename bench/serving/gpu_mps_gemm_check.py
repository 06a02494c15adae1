"""Does an MPS SM share compute right? For each thread percentage, one MPS client process runs
``server.mps.gemm_self_check`` (the check every worker under ``--sm-split`` runs at start) at the 7B
preset's hidden size, and, beside it, the same GEMMs many more times, counting wrong results.

    python3 -m bench.serving.gpu_mps_gemm_check --pcts 40,45,50,60 --out $OUT/mps_gemm_check.json

About 10 s per share on an H200; needs only torch. On a CPU it says so and writes nothing measured."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.lib.results import write_result

CHILD = r"""
import json, os, sys, torch
from distserve.server.mps import gemm_self_check
dev = torch.device("cuda")
sms = torch.cuda.get_device_properties(dev).multi_processor_count
first = gemm_self_check(dev, hidden=4096, out_features=12288)
reps = int(sys.argv[1])
wrong = 0
for _ in range(reps):  # the same check, more often: is a miss a matter of luck?
    wrong += gemm_self_check(dev, hidden=4096, out_features=12288, reps=1) is not None
print(json.dumps({"sm_count": sms, "self_check": first, "repeats": reps, "repeats_wrong": wrong}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pcts", default="40,45,50,60")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_mps_gemm_check: no CUDA device: nothing to check on a CPU")
        return 0
    from distserve.server.mps import MpsDaemon

    doc: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shares": {}}
    daemon = MpsDaemon()
    try:
        daemon.start()
        for pct in (int(p) for p in a.pcts.split(",")):
            env = {**os.environ, **daemon.env(pct)}
            p = subprocess.run(
                [sys.executable, "-c", CHILD, str(a.repeats)], env=env, capture_output=True, text=True, timeout=120
            )
            last = (p.stdout.strip().splitlines() or [""])[-1]
            try:
                row = json.loads(last)
            except json.JSONDecodeError:
                row = {"rc": p.returncode, "stderr": p.stderr[-800:]}
            doc["shares"][str(pct)] = row
            print(pct, row, flush=True)
            write_result(a.out, doc)
    finally:
        daemon.stop()
    write_result(a.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
