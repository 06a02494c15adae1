"""bench/resilience/prediction_floor.py on synthetic router journals: where the call is a function of the state the
router saw, the floor and the replayed fit find it; where it is noise around one state, no constant does better
than the noise; bad input is exit 2 with a sentence."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _journal(path: Path, calls_of) -> None:
    rng = random.Random(7)
    with gzip.open(path, "wt") as f:
        for i in range(400):
            calls = rng.randrange(0, 6)
            meas = calls_of(calls, rng)
            state = {
                "workers": {"p0": [128 * calls, calls, 0.1]},
                "queued_requests": calls,
                "queued_prefill_tokens": 128 * calls,
            }
            line = {
                "kind": "request",
                "status": 200,
                "start_unix": 1000.0 + i,
                "ttft": meas + 0.001,
                "prompt_tokens": 128,
                "ttft_parts": {"predicted": [0.0, 0.010, 0.0], "measured": [0.0, meas, 0.001], "state": state},
            }
            f.write(json.dumps(line) + "\n")
        f.write(json.dumps({"kind": "request", "status": 429, "start_unix": 2000.0}) + "\n")  # not admitted: skipped


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "bench.resilience.prediction_floor", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)


def test_a_call_the_state_determines_has_a_floor_of_nothing_and_the_fit_finds_it(tmp_path):
    j = tmp_path / "j.jsonl.gz"
    _journal(j, lambda calls, rng: 0.010 * (calls + 1))  # 10 ms per call ahead and its own
    r = _run(str(j))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prefill_call"]["samples"] == 400 and out["prefill_call"]["p90"] > 0.5  # the journal's 10 ms
    assert out["floor_prefill_call"]["p90"] < 1e-9 and out["floor_groups"] == 6
    assert out["online_fit_prefill_call"]["p90"] < 0.05


def test_noise_around_one_state_is_the_floor(tmp_path):
    j = tmp_path / "j.jsonl.gz"
    _journal(j, lambda calls, rng: 0.010 * (1.0 + 2.0 * rng.random()))  # 10-30 ms whatever the state
    out = json.loads(_run(str(j)).stdout)
    assert 0.25 < out["floor_prefill_call"]["p90"] < 0.6


def test_bad_input_is_refused_with_a_sentence(tmp_path):
    r = _run(str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "no journal at" in r.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = _run(str(empty))
    assert r.returncode == 2 and "no admitted request" in r.stderr
    r = _run(str(empty), "--forget", "0")
    assert r.returncode == 2 and "--forget must be in (0, 1]" in r.stderr
