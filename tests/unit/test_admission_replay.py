"""bench/resilience/admission_replay.py on a synthetic router journal: the replayed predictor sees the calls the
journal measured, the rule is replayed per phase, a 429's predicted TTFT is read back; bad input is exit 2."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _journal(path: Path) -> None:
    lines = []
    for i in range(300):  # one request every 50 ms, each a 20 ms call on an idle worker
        t = 1000.0 + 0.05 * i
        ttft = 0.021 if i != 150 else 0.400  # one late: a stall the router could not see
        state = {"workers": {}, "queued_requests": 0, "queued_prefill_tokens": 0}
        lines.append(
            {
                "kind": "request",
                "status": 200,
                "start_unix": t,
                "ttft": ttft,
                "prompt_tokens": 128,
                "predicted_ttft": 0.021,
                "ttft_parts": {
                    "predicted": [0.0, 0.020, 0.001],
                    "measured": [0.0, ttft - 0.001, 0.001],
                    "state": state,
                },
            }
        )
    lines.append(
        {
            "kind": "request",
            "status": 429,
            "start_unix": 1000.0 + 0.05 * 299 + 0.01,
            "error": "Rate limit reached: predicted TTFT 900 ms > SLO 250 ms (x-slo-* headers). Please retry after 1 s.",
        }
    )
    with gzip.open(path, "wt") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "bench.resilience.admission_replay", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)


def test_a_light_journal_is_admitted_as_it_was_and_a_shed_request_stays_shed(tmp_path):
    j = tmp_path / "j.jsonl.gz"
    _journal(j)
    phases = tmp_path / "phases.json"
    phases.write_text(json.dumps({"openloop": {"slo_ttft_ms": 250, "x1": {"window_unix": [1000.0, 1016.0]}}}))
    r = _run(str(j), "--phases", str(phases))
    assert r.returncode == 0, r.stderr
    x1 = json.loads(r.stdout)["phases"]["x1"]
    assert x1["arrivals"] == 301 and x1["journal"]["admitted"] == 300
    assert x1["journal"]["within_slo"] == round(299 / 300, 4)
    # nothing was ever queued: the replay admits all it admitted, and the 900 ms request is not taken in
    assert x1["replay"]["of_admitted_shed"] == 0 and x1["replay"]["of_shed_admitted_ttft_unknown"] == 0
    p50, _ = x1["replayed_vs_journal_prediction_p50_p90"]
    assert p50 < 0.05  # the replayed idle call is the journal's 20 ms (+ 1 ms overhead); the slow call moves it a while


def test_bad_input_is_exit_2_with_a_sentence(tmp_path):
    r = _run(str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "no journal" in r.stderr
    empty = tmp_path / "e.jsonl"
    empty.write_text(json.dumps({"kind": "request", "status": 400}) + "\n")
    r = _run(str(empty))
    assert r.returncode == 2 and "no admitted request" in r.stderr
