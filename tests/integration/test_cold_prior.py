"""The TTFT model's cold-start prior, through the real server (router + prefill + decode, tiny model).

A fresh router has measured no prefill call, so before the prior it could not predict a request's TTFT and
admitted only what would start within its first prefill batches (``starts_at_once``): a burst that fits in
them was admitted whole, whatever the SLO. Now each prefill worker times one prefill batch at start
(``prefill.warmup_tokens``, ``LLMEngine.measure_prefill``) and reports it at registration; the model
predicts from that cost per token until its own measurements replace it. Here the prefill worker is
slowed (the fault hook) so that no call answers during the burst: every decision is the prior's.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import pytest

from tests.integration.conftest import ServeProcess, complete, http

PROMPT = "hello " * 250  # long enough that the burst's prefill work, at the prior, dwarfs the router's own time
BURST = 16
ADMITTED_AT_PRIOR = 4.5  # the SLO: this many of the burst's prompts at the prior's cost per token


def _complete(url: str, headers: dict | None = None, max_tokens: int = 2):
    return complete(url, PROMPT, max_tokens, headers)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("coldprior")
    s = ServeProcess(tmp, config={"router": {"journal_path": str(tmp / "requests.jsonl")}})
    yield s
    s.stop()


def _ledger(s: ServeProcess) -> tuple:
    st = s.get("/v1/admission")
    return st["inflight_requests"], st["queued_requests"], st["queued_prefill_tokens"], st["unplaced_requests"]


def test_a_burst_on_a_fresh_server_is_admitted_while_the_prior_says_it_fits_the_slo(server):
    workers = {w["role"]: w for w in server.workers()}
    warm = workers["prefill"]["prefill_warmup"]
    assert warm["tokens"] > 0 and warm["ms"] > 0 and workers["decode"]["prefill_warmup"] is None
    step = workers["decode"]["decode_warmup"]  # the decode-room prior's TPOT before any stream decoded
    assert step["batch"] >= 1 and step["steps"] == 4 and step["ms"] > 0 and workers["prefill"]["decode_warmup"] is None
    model = server.get("/v1/admission")["model"]
    assert (model["source"], model["samples"], model["ready"]) == ("prior", 0, True), model
    per_token = model["prior_per_token_ms"]
    assert per_token == pytest.approx(warm["ms"] / warm["tokens"], rel=1e-3)
    code, tok, _ = http("POST", f"{server.url}/tokenize", {"prompt": PROMPT})
    assert code == 200, tok
    slo_ms = ADMITTED_AT_PRIOR * tok["count"] * per_token
    prefill = workers["prefill"]["url"]
    code, out, _ = http("POST", f"{prefill}/admin/fault", {"prefill_delay_ms": 3000})
    assert code == 200, out
    t0 = time.time()
    try:
        with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
            results = list(pool.map(lambda _: _complete(server.url, {"x-slo-ttft-ms": f"{slo_ms:.3f}"}), range(BURST)))
    finally:
        http("POST", f"{prefill}/admin/fault", {})
    codes = [c for c, _, _ in results]
    assert set(codes) <= {200, 429}, results
    # the prior lets the first few in (before the prior: all 16, blind, as they fit in the first batches) and
    # the rest, predicted past the SLO, get 429 slo_ttft with Retry-After (never unpredicted_wait: it predicts)
    assert 2 <= codes.count(200) <= 5 and codes.count(429) >= BURST - 5, codes
    for code, body, headers in results:
        if code == 429:
            assert headers["x-distserve-admission"] == "slo_ttft" and int(headers["retry-after"]) >= 1, body
    journal = [json.loads(x) for x in (server.tmp / "requests.jsonl").read_text().splitlines()]
    burst = [d for d in journal if d.get("kind") == "request" and d["start_unix"] >= t0 - 0.5]
    assert sorted(d["status"] for d in burst) == sorted(codes), burst
    admitted = [d for d in burst if d["status"] == 200]
    for d in admitted:  # each predicted (by the prior) before any call of this server had answered
        assert d["predicted_ttft"] is not None and d["ttft_parts"]["state"]["source"] == "prior", d
        if d["ttft_parts"]["state"]["queued_requests"] > 0:
            assert d["predicted_ttft"] * 1000 <= slo_ms, d
    deadline = time.monotonic() + 60
    while _ledger(server) != (0, 0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ledger(server) == (0, 0, 0, 0)


def test_the_prior_gives_way_to_measurements(server):
    for _ in range(8):  # MIN_SAMPLES answered calls in all, with the burst's
        assert _complete(server.url)[0] == 200
    model = server.get("/v1/admission")["model"]
    assert model["source"] == "measured" and model["samples"] >= 8 and model["busy_per_token_ms"] > 0, model
    metrics = urllib.request.urlopen(f"{server.url}/metrics", timeout=30).read().decode()
    assert 'distserve_ttft_model{term="prior_in_use"} 0.0' in metrics
