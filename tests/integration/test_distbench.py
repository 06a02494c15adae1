"""distbench end to end: a stub server that stalls at a known moment, Ctrl-C, exit codes, and the real
``distserve serve`` with sweep, compare, plot and merge."""

from __future__ import annotations

import ast
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from distserve.distbench import result
from distserve.distbench.loadgen import RunSpec
from distserve.distbench.metrics import pkey
from distserve.distbench.runner import Options, Workload, run
from tests.stub_server import StubServer


@pytest.fixture
def vocab_dir(tmp_path) -> str:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": 512}))
    return str(d)


def distbench(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distserve.distbench", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


def nearest_rank(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def test_open_loop_shows_the_stall_closed_loop_service_time_hides_it(vocab_dir):
    wl = Workload(prompt_len="8", output_len="4", tokenizer=vocab_dir)
    with StubServer(stall_at=30, stall_s=1.0) as srv:
        # open loop, 20 req/s, at most 2 in flight: during the stall the client cannot send on time
        spec = RunSpec(url=srv.url, strategy="constant", request_rate=20.0, max_concurrency=2, num_prompts=120)
        open_res = run(Options(spec, wl, progress=False))
    with StubServer(stall_at=30, stall_s=1.0) as srv:
        spec = RunSpec(url=srv.url, strategy="closed", concurrency=1, num_prompts=150)
        closed_res = run(Options(spec, wl, progress=False))
    assert open_res["failed"] == closed_res["failed"] == 0
    # open loop: ~20 requests were due during the stall; measured from their scheduled time they show it
    assert open_res["p99_ttft_ms"] > 700
    assert open_res["late_sends"] >= 10 and open_res["max_send_lag_ms"] > 500
    assert open_res["p99_ttft_ms"] > open_res["p99_ttft_service_ms"]  # service time hides part of it
    # closed loop: one request saw the stall, the client waited with it; P99 over 150 does not show it
    assert closed_res["max_ttft_ms"] > 900
    assert closed_res["p99_ttft_ms"] < 500
    # the result's percentiles agree with an independent computation from the per-request records
    for res in (open_res, closed_res):
        recs = result.records_of(res)
        for q in res["percentiles"]:
            want = nearest_rank([r.ttft for r in recs], q) * 1000
            assert res[f"{pkey(q)}_ttft_ms"] == pytest.approx(want, rel=1e-3, abs=2e-3)
            want = nearest_rank([r.e2e for r in recs], q) * 1000
            assert res[f"{pkey(q)}_e2el_ms"] == pytest.approx(want, rel=1e-3, abs=2e-3)


def test_failures_are_reported_with_reasons_and_count_against_the_slo(vocab_dir, tmp_path):
    with StubServer(fail_every=4) as srv:
        out = tmp_path / "r.json"
        p = distbench(
            "run",
            "--url",
            srv.url + "/v1/",
            "--concurrency",
            "2",
            "--num-prompts",
            "20",
            "--tokenizer",
            vocab_dir,
            "--output-len",
            "3",
            "--slo",
            "ttft:5s",
            "--save-result",
            str(out),
        )
        res = json.loads(out.read_text())
    assert p.returncode == 1, p.stderr
    assert res["failed"] == 5 and res["failures"] == {'HTTP 503: {"error": "overloaded, retry"}': 5}
    assert res["slo_attainment"] == pytest.approx(15 / 20)
    assert "HTTP 503" in p.stdout and "FAIL: SLO attainment 75.0% < target 90%" in p.stdout
    assert "nan" not in p.stdout


def test_exit_codes(vocab_dir, tmp_path):
    with StubServer() as srv:
        ok = distbench(
            "run",
            "--url",
            srv.url,
            "--request-rate",
            "50",
            "--num-prompts",
            "10",
            "--tokenizer",
            vocab_dir,
            "--slo",
            "ttft:10s",
            "--output-len",
            "2",
        )
        missed = distbench(
            "run",
            "--url",
            srv.url,
            "--concurrency",
            "2",
            "--num-prompts",
            "6",
            "--tokenizer",
            vocab_dir,
            "--slo",
            "ttft:1ms,e2el:1ms",
            "--output-len",
            "4",
        )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASS" in ok.stdout
    assert missed.returncode == 1 and "FAIL: SLO attainment" in missed.stdout
    for args in (
        ["--concurrency", "0"],
        ["--concurrency", "2", "--request-rate", "3"],
        ["--request-rate", "2", "--slo", "latency:3ms"],
        ["--concurrency", "1", "--prompt-len", "uniform:9:1"],
    ):
        bad = distbench("run", "--url", "http://127.0.0.1:9", *args)
        assert bad.returncode == 2
        assert bad.stderr.strip().count("\n") == 0 and bad.stderr.startswith("distbench: error:"), bad.stderr
    with StubServer() as srv:
        timed = distbench(
            "run",
            "--url",
            srv.url,
            "--request-rate",
            "20",
            "--duration",
            "1.5",
            "--tokenizer",
            vocab_dir,
            "--output-len",
            "2",
            "--save-result",
            str(tmp_path / "d.json"),
        )
        port = srv.url.rsplit(":", 1)[1]
    assert timed.returncode == 0, timed.stderr
    assert 10 <= result.load(tmp_path / "d.json")["num_prompts"] <= 60  # the clock, not a count, ended it
    gone = distbench("run", "--url", f"http://127.0.0.1:{port}", "--concurrency", "1")
    assert gone.returncode == 2 and "cannot reach" in gone.stderr


def test_sigint_stops_sending_and_writes_a_valid_partial_result(vocab_dir, tmp_path):
    out = tmp_path / "partial.json"
    with StubServer(token_delay_s=0.05) as srv:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distserve.distbench",
                "run",
                "--url",
                srv.url,
                "--request-rate",
                "10",
                "--num-prompts",
                "10000",
                "--output-len",
                "20",
                "--tokenizer",
                vocab_dir,
                "--drain-timeout",
                "0.3",
                "--save-result",
                str(out),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while srv.count < 15 and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    res = result.load(out)
    assert res["interrupted"] == "stopped by signal"
    assert 15 <= res["num_prompts"] < 10000 and res["completed"] >= 3
    assert len(res["requests"]) == res["num_prompts"]
    # ~10 requests of 1 s were in flight at the signal and had 0.3 s: recorded as cancelled, not dropped
    assert res["cancelled"] >= 3 and res["failed"] == 0
    assert res["num_prompts"] == res["completed"] + res["cancelled"]
    assert "partial result" in stdout and "stopped: draining" in stderr
    assert "PARTIAL (stopped by signal" in stdout and "PASS" not in stdout


@pytest.mark.slow
def test_against_distserve_serve_run_sweep_compare_plot_merge(serve_factory, tmp_path):
    from tests.integration.conftest import TOKEN

    srv = serve_factory(mode="colocated", decode=1)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    env = dict(os.environ, DISTSERVE_ADMIN_TOKEN=TOKEN)
    common = ["--url", srv.url + "/v1", "--prompt-len", "32", "--output-len", "8", "--no-progress"]
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "distserve.distbench",
            "run",
            *common,
            "--request-rate",
            "4",
            "--num-prompts",
            "12",
            "--warmup",
            "2",
            "--prefix-len",
            "16",
            "--save-result",
            str(a),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    ra = result.load(a)
    assert ra["completed"] == 12 and ra["total_output_tokens"] == 96
    assert all(r["prompt_tokens"] == 48 for r in ra["requests"])  # vocabulary asked from the server
    assert sum(r["warmup"] for r in ra["requests"]) == 2
    assert ra["server_metrics"]["router"]  # /metrics deltas, workers' too with the token
    assert len(ra["server_metrics"]) >= 2
    p = distbench(
        "run",
        *common,
        "--concurrency",
        "2",
        "--num-prompts",
        "10",
        "--turns",
        "2",
        "--endpoint",
        "/generate",
        "--save-result",
        str(b),
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rb = result.load(b)
    assert rb["completed"] == 10
    sessions: dict = {}
    for r in rb["requests"]:
        sessions.setdefault(r["session"], {})[r["turn"]] = r
    assert len(sessions) == 5
    for turns in sessions.values():  # the second turn carries the first and goes out after it finished
        assert turns[1]["prompt_tokens"] == 2 * 32 + 8
        assert turns[1]["scheduled"] >= turns[0]["scheduled"] + turns[0]["e2e"] - 1e-3
    cmp = distbench("compare", str(a), str(b))
    assert cmp.returncode == 0 and "TTFT" in cmp.stdout and "not established" in cmp.stdout
    assert "settings differ" in cmp.stdout  # a was open loop at 4 req/s, b a closed loop of 2 users
    merged = tmp_path / "m.json"
    m = distbench("merge", str(a), str(b), "-o", str(merged))
    assert m.returncode == 0, m.stderr
    assert result.load(merged)["completed"] == 22
    sw = distbench(
        "sweep",
        *common,
        "--slo",
        "ttft:30s,tpot:10s",
        "--num-prompts",
        "6",
        "--rate-start",
        "2",
        "--min-duration",
        "2",
        "--max-runs",
        "2",
        "--out-dir",
        str(tmp_path / "sw"),
        timeout=300,
    )
    assert sw.returncode == 0, sw.stdout + sw.stderr
    assert "goodput" in sw.stdout and (tmp_path / "sw" / "sweep.json").exists()
    pl = distbench("plot", str(a), str(b), str(tmp_path / "sw" / "sweep.json"), "--out-dir", str(tmp_path / "png"))
    assert pl.returncode == 0, pl.stderr
    for name in ("cdf.png", "timeline.png", "vs_rate.png"):
        assert (tmp_path / "png" / name).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_demo_serves_loads_and_finds_no_leak():
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "distserve.distbench.demo",
            "--requests",
            "6",
            "--concurrency",
            "3",
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("KV blocks used after the load (must be 0): "))
    assert ast.literal_eval(line.split(": ", 1)[1]) == {"prefill-0": 0, "decode-1": 0}, line
    assert "demo: PASS" in p.stdout and "completed 6" in p.stdout


def test_locust_master_and_two_workers_merge_into_one_result(vocab_dir, tmp_path):
    out = tmp_path / "locust.json"
    with StubServer(token_delay_s=0.005) as srv:
        p = distbench(
            "locust",
            "--url",
            srv.url,
            "--users",
            "4",
            "--spawn-rate",
            "4",
            "--run-time",
            "4",
            "--workers",
            "2",
            "--prompt-len",
            "8",
            "--output-len",
            "5",
            "--tokenizer",
            vocab_dir,
            "--slo",
            "ttft:5s",
            "--save-result",
            str(out),
            timeout=240,
        )
        served = srv.count
    assert p.returncode == 0, p.stdout + p.stderr
    res = result.load(out)
    assert res["num_locust_processes"] == 2  # both workers ran users and wrote their records
    assert res["completed"] == len(res["requests"]) > 10 and res["failed"] == 0
    assert abs(served - res["num_prompts"]) <= 4  # every request the server saw is in the result
    assert all(r["output_tokens"] == 5 and len(r["itl"]) == 4 for r in res["requests"])
    recs = result.records_of(res)
    for q in res["percentiles"]:  # the merged histograms say what the merged records say
        want = nearest_rank([r.ttft for r in recs], q) * 1000
        assert res[f"{pkey(q)}_ttft_ms"] == pytest.approx(want, rel=1e-3, abs=2e-3)


def test_stop_on_saturation_and_trace_replay(vocab_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "\n".join(json.dumps({"timestamp": 100 + t, "prompt_len": 6, "output_len": 2}) for t in (0.0, 0.4, 0.8, 2.0))
    )
    with StubServer() as srv:
        sat = distbench(
            "run",
            "--url",
            srv.url,
            "--request-rate",
            "40",
            "--num-prompts",
            "400",
            "--tokenizer",
            vocab_dir,
            "--output-len",
            "2",
            "--slo",
            "ttft:0.001ms",
            "--stop-on-saturation",
            "--save-result",
            str(tmp_path / "sat.json"),
        )
        rep = distbench(
            "run",
            "--url",
            srv.url,
            "--dataset",
            f"jsonl:{trace}",
            "--strategy",
            "trace",
            "--time-scale",
            "2",
            "--tokenizer",
            vocab_dir,
            "--save-result",
            str(tmp_path / "rep.json"),
        )
    assert sat.returncode == 1, sat.stdout + sat.stderr
    res = result.load(tmp_path / "sat.json")
    assert res["interrupted"].startswith("saturated") and res["num_prompts"] < 400
    assert "FAIL" in sat.stdout
    assert rep.returncode == 0, rep.stdout + rep.stderr
    rr = result.load(tmp_path / "rep.json")
    assert [r["scheduled"] for r in rr["requests"]] == pytest.approx([0.0, 0.2, 0.4, 1.0])
    assert [r["prompt_tokens"] for r in rr["requests"]] == [6, 6, 6, 6]
