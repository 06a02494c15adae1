"""The decode-room wait on a fresh server, through the real server (router + prefill + decode, tiny model).

A server that has released no decode slot yet knew nothing of how long a wait for room takes: with every slot
held, the next request that would wait behind another got 429 ``unpredicted_wait`` until the first admitted
request ended (issue 26, the seed's 300-user run). The room prior predicts it from the streams holding the
slots: their tokens left (to ``max_tokens``) x the TPOT they are decoding at. Here decode has 2 slots and is
slowed (the fault hook), so the two holders are still decoding when the next requests arrive.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import pytest

from tests.integration.conftest import ServeProcess, complete, http

SLOTS = 2
DECODE_DELAY_MS = 100
HOLD_TOKENS = 30


def _complete(url: str, max_tokens: int):
    return complete(url, "hello there", max_tokens)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("roomprior")
    s = ServeProcess(
        tmp,
        config={
            "router": {"journal_path": str(tmp / "requests.jsonl")},
            "decode": {"max_concurrent_requests": SLOTS},
        },
    )
    yield s
    s.stop()


def _until(s: ServeProcess, cond, what: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        st = s.get("/v1/admission")
        if cond(st):
            return st
        assert time.monotonic() < deadline, f"{what}: {st}"
        time.sleep(0.05)


def test_a_wait_for_decode_room_on_a_fresh_server_is_predicted_from_the_streams_holding_the_slots(server):
    decode = next(w for w in server.workers() if w["role"] == "decode")
    code, out, _ = http("POST", f"{decode['url']}/admin/fault", {"decode_delay_ms": DECODE_DELAY_MS})
    assert code == 200, out
    t0 = time.time()
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            holders = [pool.submit(_complete, server.url, HOLD_TOKENS) for _ in range(SLOTS)]
            # both slots held and decoding (two tokens or more each): the prior has their live TPOT (before, it
            # had the decode worker's start-up step, which knows nothing of the fault's delay)
            st = _until(
                server,
                lambda st: st["model"]["room_source"] == "prior" and (st["model"]["room_prior"] or {}).get("tpot_live"),
                "the room prior in use, on the live streams",
            )
            m = st["model"]
            assert m["slot_held_ms"] is None and m["room_per_release_ms"] is None, m  # nothing released yet
            assert m["room_prior"]["holders"] == SLOTS and m["room_prior"]["tpot_ms"] > 0, m
            metrics = urllib.request.urlopen(f"{server.url}/metrics", timeout=30).read().decode()
            assert 'distserve_ttft_model{term="room_prior_in_use"} 1.0' in metrics
            # a third request waits for a slot (admitted: nothing queued ahead of it)
            third = pool.submit(_complete, server.url, 2)
            _until(server, lambda st: st["unplaced_requests"] == 1, "the third waiting for decode room")
            # a fourth, behind it: without the prior this was 429 unpredicted_wait; now its wait is predicted
            code, body, headers = _complete(server.url, 2)
            assert code == 200, (code, body, headers)
            results = [f.result() for f in (*holders, third)]
    finally:
        http("POST", f"{decode['url']}/admin/fault", {})
    assert [r[0] for r in results] == [200] * (SLOTS + 1), results
    journal = [json.loads(x) for x in (server.tmp / "requests.jsonl").read_text().splitlines()]
    runs = [d for d in journal if d.get("kind") == "request" and d["start_unix"] >= t0 - 0.5]
    assert len(runs) == SLOTS + 2, runs
    fourth = max(runs, key=lambda d: d["start_unix"])
    tp = fourth["ttft_parts"]
    assert tp["state"]["queued_requests"] > 0, tp  # judged: something was queued ahead of it
    assert tp["state"]["room_source"] == "prior" and tp["state"]["releases"] == 2, tp
    # predicted to wait for the 2nd release: most of a holder's tokens left at the slowed TPOT
    assert tp["predicted"][0] > 0.2 * HOLD_TOKENS * DECODE_DELAY_MS / 1000, tp
    refused = [d for d in journal if d.get("kind") == "admission" and d["at_unix"] >= t0 - 0.5]
    assert refused == [], refused
    # the measured releases take over, and nothing is left in the ledger
    st = _until(server, lambda st: st["inflight_requests"] == 0 and st["unplaced_requests"] == 0, "the ledger at 0")
    assert st["queued_requests"] == 0 and st["model"]["room_source"] in ("slot_held", "waits"), st
