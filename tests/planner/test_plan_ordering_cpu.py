"""On this CPU with the tiny model: ``distserve plan`` ranks colocated vs disaggregated the way real servers
measured with distbench rank them, for two workloads that rank them differently.

- prompt 512, output 2, TPOT <= 15 ms: a disaggregated request's one TPOT gap holds the KV pull of its
  16 MiB prompt (tcp over loopback) and the hand-off to the decode worker, which colocated replicas never pay;
- prompt 1024, output 16, TPOT <= 30 ms: in a colocated replica every 1024-token prefill (hundreds of ms
  here) stalls the other requests' decodes, which a separate decode worker never sees.
The profile is measured here (quick sweep), the plan is simulated at the rate the load then runs at, and the
measured attainment of each layout decides the measured order. Real processes: about two minutes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from planner.layouts import EngineLimits, Layout
from planner.profile import load
from planner.search import Planner
from planner.slo import SLO, attainment
from planner.validate import measure_layout
from planner.workload import load_workload

CASES = [  # (prompt, output, SLO, rate req/s, requests)
    ("512", "2", "ttft:3000ms,tpot:15ms", 1.0, 16),
    ("1024", "16", "ttft:5000ms,tpot:30ms", 1.0, 16),
]


@pytest.mark.slow
def test_plan_predicts_the_measured_order_of_colocated_and_disaggregated(tmp_path):
    prof_path = tmp_path / "profile.json"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "server.cli",
            "profile",
            "--device",
            "cpu",
            "--quick",
            "--no-threads",
            "--out",
            str(prof_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    prof = load(prof_path)
    lim = EngineLimits(64, 4096)
    layouts = {
        "colocated": Layout("colocated", 0, 2, lim, lim),
        "disaggregated": Layout("disaggregated", 1, 1, lim, lim),
    }
    report = []
    for prompt, output, slo_text, rate, num in CASES:
        slo = SLO.parse(slo_text)
        planner = Planner.for_profile(prof, load_workload(f"prompt={prompt},output={output}", n=200), slo)
        predicted = {name: attainment(slo, planner.run(lay, rate).latencies) for name, lay in layouts.items()}
        measured = {
            name: measure_layout(lay, prompt, output, [rate], num, slo_text, workdir=tmp_path / f"{name}{prompt}")[0]
            for name, lay in layouts.items()
        }
        report.append(
            {
                "workload": f"{prompt}/{output}",
                "slo": slo_text,
                "rate": rate,
                "predicted": predicted,
                "measured": {k: v.attainment for k, v in measured.items()},
            }
        )
    print(json.dumps(report, indent=1))
    for r in report:
        pred, meas = r["predicted"], r["measured"]
        assert pred["colocated"] != pred["disaggregated"] and meas["colocated"] != meas["disaggregated"], report
        assert max(meas, key=meas.__getitem__) == max(pred, key=pred.__getitem__), json.dumps(report, indent=1)
    winners = {max(r["predicted"], key=r["predicted"].__getitem__) for r in report}
    assert winners == {"colocated", "disaggregated"}, report  # the two workloads rank them differently
