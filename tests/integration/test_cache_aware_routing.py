"""Cache-aware routing and latency outlier ejection end to end: `distserve serve --prefill 2
--decode 1` on the tiny model, real processes over loopback.

A long prompt's follow-ups (a multi-turn chat re-sends the conversation) land on the prefill worker that
cached it, whose prefix-hit counter rises while the other's does not (the least-load pick would alternate);
a killed worker's summary is dropped and its restarted process starts with none; a prefill worker slowed
by the fault hook is ejected (logged, /metrics, /v1/workers), gets no new request while ejected, and
returns after its cooling period. No KV block leaks.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from .conftest import http

pytestmark = pytest.mark.slow

OUTLIER = {
    "enabled": True,
    "min_samples": 3,
    "factor": 3.0,
    "min_excess_ms": 300.0,
    "ejection_s": 3.0,
    "window_s": 60.0,
}
# local prefill for prompts of at most 2 uncached tokens: only the last request below qualifies
ROUTER = {"prefix_cache_weight": 2.0, "outlier": OUTLIER, "local_prefill_max_tokens": 2}
CONV = [1] + [3 + (5 * k) % 300 for k in range(160)]  # 161 tokens: 10 full blocks of 16


def _complete(url: str, prompt: list[int]) -> None:
    code, body, _ = http(
        "POST", f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    )
    assert code == 200 and body["choices"][0]["finish_reason"] == "length", body


def _metric(text: str, name: str) -> float:
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name) and not ln.startswith("#"))


def _prefill_workers(server) -> dict[str, dict]:
    return {w["worker_id"]: w for w in server.workers() if w["role"] == "prefill" and w["healthy"]}


def _hits(worker: dict) -> float:
    _, text, _ = http("GET", f"{worker['url']}/metrics")
    return _metric(text, "distserve_prefix_cache_hit_tokens")


def _wait(cond, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_follow_ups_land_on_the_cached_worker_and_slow_workers_are_ejected(serve_factory, tmp_path):
    journal = tmp_path / "journal.jsonl"
    server = serve_factory(prefill=2, decode=1, config={"router": {**ROUTER, "journal_path": str(journal)}})
    url = server.url
    _wait(lambda: len(_prefill_workers(server)) == 2, "two prefill workers")
    _complete(url, CONV)  # turn 1: computed on whichever worker
    holder = _wait(
        lambda: next((w for w in _prefill_workers(server).values() if w["prefix_blocks"] >= 10), None),
        "the prefix summary on a heartbeat",
    )
    other = next(w for w in _prefill_workers(server).values() if w["worker_id"] != holder["worker_id"])
    before = {w["worker_id"]: _hits(w) for w in (holder, other)}
    for turn in range(4):  # follow-ups: the conversation so far plus a new message
        _complete(url, CONV + [7 + turn, 9, 11 + turn])
    assert _hits(holder) - before[holder["worker_id"]] >= 4 * 160  # each reused the 10 cached blocks
    assert _hits(other) == before[other["worker_id"]]  # least-load would have sent two of them here
    ws = _prefill_workers(server)
    assert ws[holder["worker_id"]]["prefix_routed_hits"] >= 4
    _, text, _ = http("GET", f"{url}/metrics")
    assert _metric(text, 'distserve_prefix_aware_picks_total{outcome="hit"}') >= 4
    assert _metric(text, 'distserve_prefill_path_total{path="disaggregated"}') >= 5

    # killed: its summary is dropped at once; the restarted process registers with none of the old entries
    os.kill(holder["pid"], signal.SIGKILL)
    gone = _wait(
        lambda: (
            next(
                (w for w in server.workers() if w["worker_id"] == holder["worker_id"] and w["pid"] != holder["pid"]),
                None,
            )
            or next(
                (w for w in server.workers() if w["worker_id"] == holder["worker_id"] and w["state"] == "dead"), None
            )
        ),
        "the kill to be seen",
    )
    assert gone["prefix_blocks"] == 0
    back = _wait(
        lambda: (
            _prefill_workers(server).get(holder["worker_id"])
            if _prefill_workers(server).get(holder["worker_id"], {}).get("pid") not in (None, holder["pid"])
            else None
        ),
        "the restarted worker",
        timeout=60,
    )
    assert back["prefix_blocks"] == 0
    _complete(url, CONV + [5, 5])  # served (by either worker: neither holds it now)

    # ejection: one prefill worker slowed; distinct prompts alternate until it is judged an outlier
    slow, fast = sorted(_prefill_workers(server).values(), key=lambda w: w["worker_id"])
    # 3 s: well above 3 x the other's P90, which a cold start on a loaded machine can push past 0.5 s
    code, _, _ = http("POST", f"{slow['url']}/admin/fault", {"prefill_delay_ms": 3000})
    assert code == 200
    for i in range(20):
        _complete(url, [1, 50 + i, 60 + i, 70 + i])
        if _prefill_workers(server)[slow["worker_id"]]["ejected"]:
            break
    ws = _prefill_workers(server)
    assert ws[slow["worker_id"]]["ejected"] and not ws[fast["worker_id"]]["ejected"], ws
    _, text, _ = http("GET", f"{url}/metrics")
    assert _metric(text, 'distserve_worker_ejections_total{role="prefill"}') >= 1
    assert _metric(text, 'distserve_workers_ejected{role="prefill"}') == 1
    hits_slow = _hits(slow)
    queried = _metric(http("GET", f"{slow['url']}/metrics")[1], "distserve_prefix_cache_queried_tokens")
    for i in range(3):
        _complete(url, [1, 90 + i, 91, 92])
    after = _metric(http("GET", f"{slow['url']}/metrics")[1], "distserve_prefix_cache_queried_tokens")
    assert after == queried and _hits(slow) == hits_slow  # no new request reached it while ejected
    router_log = server.tmp / "logs" / "router.log"
    assert "ejected for" in router_log.read_text()
    http("POST", f"{slow['url']}/admin/fault", {})
    _wait(lambda: not _prefill_workers(server)[slow["worker_id"]]["ejected"], "the return", timeout=15)
    assert "back in rotation" in router_log.read_text()

    # conditional disaggregation: a prompt short enough is prefilled on the decode worker itself
    _complete(url, [1, 5])
    _, text, _ = http("GET", f"{url}/metrics")
    assert _metric(text, 'distserve_prefill_path_total{path="local"}') == 1
    paths = _wait(
        lambda: (lambda p: p if "local" in p else None)(
            [json.loads(ln).get("path") for ln in journal.read_text().splitlines() if '"request"' in ln]
        ),
        "the journal",
    )
    assert paths[-1] == "local" and set(paths[:-1]) == {"disaggregated"}, paths
    state = server.wait_kv_free()
    assert not any(state["used"].values()) and not any(state["staged"].values()), state
