"""The latency breaker end to end: a disaggregated primary, a colocated backup, a fault hook.

Real processes over loopback: `distserve serve` (router + prefill + decode) is the
primary and a second `distserve serve --mode colocated` is its backup pool. A steady
trickle of streaming requests runs through the whole sequence: the prefill worker is
slowed through POST /admin/fault → the breaker opens and new requests are answered by
the backup (header), while the slow in-flight ones still complete → the fault is
cleared → half-open probes → closed. Not one request fails. The router's journals are
then audited with `sla.audit`, and /metrics parses with prometheus_client.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from distserve.sla.audit import audit
from distserve.sla.records import load_records
from distserve.sla.spec import SlaSpec

from .conftest import TOKEN, free_port, http

pytestmark = pytest.mark.slow

CONSECUTIVE_S = 1.0
BREAKER = {
    "enabled": True,
    "metric": "ttft",
    "percentile": 50.0,
    "threshold_ms": 400.0,
    "consecutive_s": CONSECUTIVE_S,
    "cooldown_s": 3.0,
    "probe_fraction": 0.5,
    "min_samples": 3,
    "probe_samples": 3,
}
MAX_TOKENS = 6


async def one_request(s: aiohttp.ClientSession, url: str, i: int, log: list[dict]) -> None:
    # no "model": a client naming another model gets 404 model_not_found before any pool is chosen
    body = {
        "prompt": [1] + [3 + (i * 7 + k) % 250 for k in range(12)],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    rec = {"i": i, "start": time.monotonic(), "status": None, "pool": None, "chunks": 0, "error": None}
    log.append(rec)
    try:
        async with s.post(f"{url}/v1/completions", json=body) as r:
            rec["status"], rec["pool"] = r.status, r.headers.get("x-distserve-pool")
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    data = json.loads(line[6:])
                    if "error" in data:
                        rec["error"] = data["error"]
                    elif data.get("choices"):
                        rec["chunks"] += 1
                        rec["finish"] = data["choices"][0].get("finish_reason") or rec.get("finish")
                elif line == "data: [DONE]":
                    rec["done"] = True
    except Exception as e:  # recorded and asserted on below: a failed request fails the test
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["end"] = time.monotonic()


async def status(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(f"{url}/sla/status") as r:
        assert r.status == 200
        return await r.json()


async def wait_state(s, url: str, want: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = await status(s, url)
        if st["breaker"]["state"] == want:
            return st
        assert time.monotonic() < deadline, f"breaker never reached {want}: {st['breaker']}"
        await asyncio.sleep(0.1)


async def fault(s, worker_url: str, body: dict) -> dict:
    async with s.post(f"{worker_url}/admin/fault", json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def test_breaker_fails_over_to_backup_and_back(serve_factory, tmp_path):
    # the backup names its model differently, as a vLLM deployment would: the router rewrites `model` for it.
    # Its port is chosen here, so both servers start at once (the primary only calls its backup once the
    # breaker opens, and the scenario starts once both are ready)
    backup_url = f"http://127.0.0.1:{free_port()}"
    journal, events = tmp_path / "requests.jsonl", tmp_path / "events.jsonl"
    primary_config = {
        "router": {
            "backup_pool": [backup_url],
            "backup_model": "tiny-backup",
            "sla_window_s": 3,
            "journal_path": str(journal),
            "event_journal_path": str(events),
            "breaker": BREAKER,
        }
    }
    with ThreadPoolExecutor(2) as pool:
        starting_backup = pool.submit(
            serve_factory,
            mode="colocated",
            extra_args=("--served-model-name", "tiny-backup", "--port", backup_url.rsplit(":", 1)[1]),
        )
        starting_primary = pool.submit(serve_factory, config=primary_config)
        backup, primary = starting_backup.result(), starting_primary.result()
    assert backup.url == backup_url
    prefill = next(w for w in primary.workers() if w["role"] == "prefill")

    # the fault hook is an admin endpoint
    assert http("POST", f"{prefill['url']}/admin/fault", {"prefill_delay_ms": 5}, token=None)[0] == 401
    code, body, _ = http("POST", f"{prefill['url']}/admin/fault", {"prefil_delay_ms": 5})
    assert code == 422 and "prefil_delay_ms" in json.dumps(body)

    log: list[dict] = []
    marks: dict[str, float] = {}

    async def scenario() -> None:
        async with aiohttp.ClientSession() as s:
            stop = asyncio.Event()
            tasks: list[asyncio.Task] = []

            async def trickle() -> None:
                i = 0
                while not stop.is_set():
                    tasks.append(asyncio.create_task(one_request(s, primary.url, i, log)))
                    i += 1
                    await asyncio.sleep(0.12)

            sender = asyncio.create_task(trickle())
            await asyncio.sleep(2.0)
            assert (await status(s, primary.url))["breaker"]["state"] == "closed"

            assert await fault(s, prefill["url"], {"prefill_delay_ms": 1500}) == {
                "prefill_delay_ms": 1500.0,
                "decode_delay_ms": 0.0,
                "block_step_ms": 0.0,
                "stage_delay_ms": 0.0,
            }
            marks["fault"] = time.monotonic()
            # The breach becomes visible when the judged percentile passes the threshold;
            # from then the breaker must open within consecutive_s (+1 s of slack).
            while True:
                st = await status(s, primary.url)
                j = st["breaker"]["judged"]
                if st["breaker"]["state"] == "open":
                    break
                if (
                    "breach" not in marks
                    and j["value_ms"]
                    and j["value_ms"] > BREAKER["threshold_ms"]
                    and j["samples"] >= BREAKER["min_samples"]
                ):
                    marks["breach"] = time.monotonic()
                assert time.monotonic() - marks["fault"] < 60, st["breaker"]
                await asyncio.sleep(0.05)
            marks["open"] = time.monotonic()
            await asyncio.sleep(1.5)  # requests sent while open go to the backup
            marks["clear"] = time.monotonic()
            assert await fault(s, prefill["url"], {}) == {
                "prefill_delay_ms": 0.0,
                "decode_delay_ms": 0.0,
                "block_step_ms": 0.0,
                "stage_delay_ms": 0.0,
            }
            await wait_state(s, primary.url, "closed", timeout=60)
            marks["closed"] = time.monotonic()
            await asyncio.sleep(1.0)
            stop.set()
            await sender
            await asyncio.gather(*tasks)

    asyncio.run(scenario())

    # zero failed requests across the whole sequence, every one complete
    bad = [r for r in log if r["status"] != 200 or r["error"] or not r.get("done") or r["chunks"] < 1]
    assert not bad, bad[:5]
    assert all(r["pool"] in ("primary", "backup") for r in log)
    # the breaker opened within consecutive_s + 1 s of the breach becoming visible
    if "breach" in marks:
        assert marks["open"] - marks["breach"] <= CONSECUTIVE_S + 1.0, marks
    # requests sent while it was open were answered by the backup...
    during = [r for r in log if marks["open"] + 0.3 < r["start"] < marks["clear"]]
    assert during and all(r["pool"] == "backup" for r in during), [(r["i"], r["pool"]) for r in during]
    # ...while slow primary requests in flight at the transition completed on the primary
    inflight = [r for r in log if r["pool"] == "primary" and r["start"] < marks["open"] < r["end"]]
    assert inflight, "expected primary requests in flight when the breaker opened"
    # after closing, the primary serves again
    after = [r for r in log if r["start"] > marks["closed"] + 0.3]
    assert after and all(r["pool"] == "primary" for r in after)

    # the event journal has the cycle; the request journal audits with the sla package
    ev = [json.loads(x) for x in events.read_text().splitlines()]
    seq = [(e["from_state"], e["to_state"]) for e in ev]
    assert seq[0] == ("closed", "open") and seq[-1] == ("half_open", "closed")
    assert ("open", "half_open") in seq
    data = load_records([journal])
    assert {r.pool for r in data.records} == {"primary", "backup"}
    assert len(data.records) == len(log) and all(r.ok for r in data.records)
    # one window over the whole run: a P99 of ~100 samples is judged only when >= 10 broke it (sla/audit.py's
    # thin-tail rule), which the fault's slow TTFTs (the breaker needs a P50 breach to open) do
    spec = SlaSpec.from_dict(
        {
            "window_s": 3600,
            "availability": 1.0,
            "objectives": [{"metric": "ttft", "percentile": 99, "threshold_ms": 1000}],
        }
    )
    rep = audit(spec, data)
    slow = sum(r.ttft is not None and r.ttft > 1.0 for r in data.records)
    assert slow >= 10 and rep.verdict == "fail", (slow, rep.verdict)  # the fault's slow TTFTs breach a 1 s objective
    assert all(r.status == "pass" for r in rep.rows if r.objective == "availability")

    # /metrics parses and holds the rolling percentiles and the breaker's metrics
    code, text, _ = http("GET", f"{primary.url}/metrics", token=None)
    assert code == 200
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    lat = fams["distserve_sla_rolling_latency_seconds"].samples
    assert {s.labels["metric"] for s in lat} >= {"ttft", "tpot", "e2e"}
    assert any(s.labels["quantile"] == "0.99" and s.value > 0 for s in lat)
    assert fams["distserve_breaker_state"].samples[0].value == 0
    trans = {
        (s.labels["from_state"], s.labels["to_state"]): s.value
        for s in fams["distserve_breaker_transitions"].samples
        if s.name.endswith("_total")
    }
    assert trans[("closed", "open")] >= 1 and trans[("half_open", "closed")] == 1
    pools = {s.labels["pool"]: s.value for s in fams["distserve_pool_requests"].samples if s.name.endswith("_total")}
    assert pools["primary"] > 0 and pools["backup"] > 0 and sum(pools.values()) == len(log)
    assert primary.wait_kv_free()["used"] and not any(primary.wait_kv_free()["used"].values())
