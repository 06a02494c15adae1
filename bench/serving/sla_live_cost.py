#!/usr/bin/env python
"""What the router's live SLA view costs: recording one finished request, one /metrics scrape.

    bench/serving/sla_live_cost.py [--window-s 60] [--itl 63] [--repeats 5]

Fills a full window (one request per 10 ms of fake time for --window-s seconds), then times
SlaLive.record for a request with --itl ITL samples and one collection of the rolling-percentile
metrics (what a Prometheus scrape adds), and the breaker's tick, in CPU time of this thread (so that
other load on the machine does not inflate them). Prints medians over --repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

from prometheus_client import CollectorRegistry, generate_latest

from distserve.server.config import load_config
from distserve.server.router.sla_live import Finished, SlaLive


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window-s", type=int, default=60)
    p.add_argument("--itl", type=int, default=63)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    now = [1000.0]
    cfg = load_config(overrides={"router": {"sla_window_s": a.window_s, "breaker": {"enabled": True}}}).router
    live = SlaLive(cfg, CollectorRegistry(), backup_configured=True, clock=lambda: now[0])
    f = Finished("primary", 0.0, 0.0, True, ttft=0.05, tpot=0.02, e2e=1.3, itl=tuple([0.02] * a.itl))
    rec, scrape, tick = [], [], []
    for _ in range(a.repeats):
        n = 0
        t0 = time.thread_time()
        for _ in range(a.window_s * 100):
            now[0] += 0.01
            live.record(f)
            n += 1
        rec.append((time.thread_time() - t0) / n)
        t0 = time.thread_time()
        generate_latest(live.registry)
        scrape.append(time.thread_time() - t0)
        t0 = time.thread_time()
        live.tick()
        tick.append(time.thread_time() - t0)
    print(f"record one request ({a.itl} ITL samples): {statistics.median(rec) * 1e6:.0f} us")
    print(f"scrape with a full {a.window_s} s window: {statistics.median(scrape) * 1e3:.1f} ms")
    print(f"breaker tick: {statistics.median(tick) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
