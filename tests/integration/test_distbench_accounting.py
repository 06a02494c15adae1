"""distbench's accounting against scripted in-process servers (tests/stub_server.py): the bounded drain
and cancelled requests, the closed-loop back-off, a sweep against a server of known capacity, the
README's plot sequence, and ``repeat`` feeding a between-run ``compare``."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from distserve.distbench import result
from distserve.distbench.loadgen import RunSpec
from distserve.distbench.plot import plot
from distserve.distbench.runner import Options, Workload, run
from distserve.distbench.summary import format_summary
from distserve.distbench.sweep import sweep
from tests.stub_server import StubServer


@pytest.fixture
def vocab_dir(tmp_path) -> str:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": 512}))
    return str(d)


def test_duration_drains_with_a_line_and_records_the_rest_as_cancelled(vocab_dir, capsys):
    wl = Workload(prompt_len="8", output_len="20", tokenizer=vocab_dir)
    with StubServer(token_delay_s=0.2) as srv:  # 4 s per request: all still streaming at the end
        spec = RunSpec(url=srv.url, strategy="constant", request_rate=8.0, duration_s=1.0, drain_s=0.3)
        res = run(Options(spec, wl, slo="ttft:2s", progress=False))
    err = capsys.readouterr().err
    n = res["num_prompts"]
    assert 6 <= n <= 10 and res["failed"] == 0 and res["completed"] == 0
    assert res["cancelled"] == n == len(res["requests"])  # counted, not dropped
    assert f"duration reached: draining {n} requests, up to 0.3 s" in err
    recs = result.records_of(res)
    assert all(r.cancelled and r.cancelled_after is not None and r.cancelled_after > 0.3 for r in recs)
    assert res["failures"] == {}
    assert res["slo_judged"] == 0  # each had its first token in time: no verdict either way
    assert res["verdict"]["pass"] is False and res["verdict"]["line"].startswith("PARTIAL (duration reached")
    assert res["duration"] < 3.0  # bounded: not the 4 s the requests wanted


def test_closed_loop_backs_off_after_fast_failures(vocab_dir):
    wl = Workload(prompt_len="8", output_len="2", tokenizer=vocab_dir)
    with StubServer(fail_every=1) as srv:  # every request fails at once (HTTP 503)
        spec = RunSpec(url=srv.url, strategy="closed", concurrency=4, duration_s=2.0, num_prompts=10**9)
        polite = run(Options(spec, wl, progress=False))
        flood = run(
            Options(
                RunSpec(url=srv.url, strategy="closed", concurrency=4, duration_s=1.0, backoff_s=0, num_prompts=10**9),
                wl,
                progress=False,
            )
        )
    # back-off doubles from 50 ms to 2 s: a user sends about 6 requests in 2 s
    assert polite["num_prompts"] <= 4 * 8, polite["num_prompts"]
    assert polite["backoff_delays"] >= polite["num_prompts"] - 4
    assert polite["backoff_total_s"] > 4 * 1.0
    delays = [r.backoff for r in result.records_of(polite) if r.backoff]
    assert max(delays) <= 2.0 and min(delays) >= 0.025  # bounded, and jittered around the doubling
    assert "sends delayed after a fast failure" in format_summary(polite)
    assert flood["num_prompts"] > 5 * polite["num_prompts"] and flood["backoff_delays"] == 0


def test_429s_are_counted_apart_and_closed_loop_users_wait_their_retry_after(vocab_dir):
    wl = Workload(prompt_len="8", output_len="2", tokenizer=vocab_dir)
    with StubServer(rate_limit_every=2) as srv:  # every other request: 429 with Retry-After: 1
        spec = RunSpec(url=srv.url, strategy="closed", concurrency=2, duration_s=2.5, num_prompts=10**9)
        res = run(Options(spec, wl, progress=False))
    recs = result.records_of(res)
    limited = [r for r in recs if r.rate_limited]
    assert limited and res["rate_limited"] == len(limited) == res["rate_limited_with_retry_after"]
    assert res["failed"] == 0 and res["failures"] == {} and res["completed"] >= 2
    assert res["completed"] + res["rate_limited"] + res["cancelled"] == res["num_prompts"]
    assert all(r.retry_after == 1.0 for r in limited)
    # the request a user sent after its 429 waited the Retry-After (1 s, plus at most 10 % jitter)
    waits = [r.backoff for r in recs if r.backoff]
    assert waits and all(1.0 <= w <= 1.1 for w in waits), waits
    # a 200 and a 429 per Retry-After: at most ~3 such pairs per user in 2.5 s (without honouring the
    # header, a stub this fast answers thousands)
    assert res["num_prompts"] <= 2 * 2 * 4, res["num_prompts"]
    line = res["verdict"]["line"]
    assert res["verdict"]["pass"] and line.startswith("PASS: 0 failed"), line
    assert f"{len(limited)} refused with 429 (all with Retry-After), not counted as failures" in line, line
    text = format_summary(res)
    assert f"rate-limited (429) {len(limited)}" in text and "failures:" not in text, text


def test_a_run_in_which_every_request_got_a_429_does_not_pass(vocab_dir):
    wl = Workload(prompt_len="8", output_len="2", tokenizer=vocab_dir)
    with StubServer(rate_limit_every=1, retry_after=None) as srv:  # always 429, no Retry-After header
        res = run(
            Options(RunSpec(url=srv.url, strategy="constant", request_rate=20.0, num_prompts=5), wl, progress=False)
        )
    assert res["rate_limited"] == 5 and res["rate_limited_with_retry_after"] == 0 and res["failed"] == 0
    assert res["verdict"]["pass"] is False
    assert res["verdict"]["line"] == "FAIL: no request completed: 5 of 5 refused with 429", res["verdict"]


def test_sweep_finds_a_known_capacity_and_never_calls_a_saturated_point_goodput(vocab_dir, tmp_path):
    # 2 slots x 5 gaps of 10 ms: 0.05 s per request, capacity 40 req/s; the SLO is loose (10 s), so
    # only the saturation rule stops a rate above capacity from passing
    wl = Workload(prompt_len="8", output_len="6", tokenizer=vocab_dir)
    capacity = 2 / (5 * 0.01)
    with StubServer(token_delay_s=0.01, max_active=2) as srv:
        opts = Options(RunSpec(url=srv.url, request_rate=10.0, num_prompts=10), wl, slo="ttft:10s", progress=False)
        s = sweep(opts, 10.0, 0.1, 6, tmp_path / "sw", log=lambda _: None, min_duration_s=1.5)
        plain = run(Options(RunSpec(url=srv.url, request_rate=20.0, num_prompts=12), wl, progress=False))
    pts = s["points"]
    assert all(p["sent"] >= math.ceil(1.5 * p["rate"]) for p in pts)  # the minimum duration of sending
    assert not any(p["saturated"] and p["pass"] for p in pts)
    assert all(p["saturated"] for p in pts if p["rate"] >= 1.5 * capacity)
    assert capacity / 2 <= s["goodput_rate"] <= 1.15 * capacity, pts
    assert s["bracketed"]
    # the README's plot sequence: a run with an SLO, one without, and the sweep
    result.save(plain, tmp_path / "b.json")
    with_slo = result.load(tmp_path / "sw" / "rate_10.json")
    paths = plot(
        [("a", with_slo), ("b", plain), ("sweep", json.loads((tmp_path / "sw" / "sweep.json").read_text()))],
        tmp_path / "png",
    )
    assert sorted(p.name for p in paths) == ["cdf.png", "timeline.png", "vs_rate.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_repeat_interleaves_and_compare_tests_between_runs(vocab_dir, tmp_path):
    with StubServer() as srv:
        common = (
            f"--url {srv.url} --request-rate 40 --num-prompts 12 --output-len 3 --tokenizer {vocab_dir} --no-progress"
        )
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "distserve.distbench",
                "repeat",
                "2",
                "--out-dir",
                str(tmp_path / "rep"),
                "--variant",
                f"A={common}",
                "--variant",
                f"B={common} --prompt-len 16",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert p.returncode == 0, p.stdout + p.stderr
    order = [ln.split("]")[0] + "]" for ln in p.stdout.splitlines() if ln.startswith("[")]
    assert order == ["[A 1/2]", "[B 1/2]", "[A 2/2]", "[B 2/2]"]
    seeds = [result.load(tmp_path / "rep" / f"A_{i}.json")["config"]["seed"] for i in (1, 2)]
    assert seeds == [0, 1]
    assert "A = A (2 runs), B = B (2 runs)" in p.stdout and "between runs" in p.stdout
    assert "workload.prompt_len: '128' (A) vs '16' (B)" in p.stdout
